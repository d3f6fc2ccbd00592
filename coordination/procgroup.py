"""Process groups of the children a node starts (torchrun, inference servers).

Children run in their own session so they can be stopped as a group, and ask the kernel to
SIGTERM them when the process that started them dies, even by SIGKILL: a node restarted after
a crash must never find the old torchrun or inference server still holding the accelerator."""
from __future__ import annotations

import os
import signal
import subprocess


def die_with_parent() -> None:
    """preexec_fn for subprocess.Popen: PR_SET_PDEATHSIG(SIGTERM) on Linux, a no-op elsewhere.
    Children must be started from the thread that lives as long as the parent process (the main
    thread): the kernel signals when that thread ends."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the child's process group, wait, then SIGKILL; returns when the child is reaped."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (torchrun's workers)
    except ProcessLookupError:
        pass
    proc.wait()
