"""Starting and stopping the children a node runs (torchrun, inference servers): docs/design.md §2.

Every child is started by `start_child`, and only there:
- no Python code runs between fork and exec: `Popen` forks and execs in C (no `preexec_fn`) into
  `exec_shim.py`, which arms the parent-death signal and execs the command, so a node with
  threads cannot deadlock in a forked copy of itself;
- the launch is bounded: if the shim has not exec'd the command within `start_timeout` seconds,
  its group is killed and `ChildStartError` names the command;
- the child runs in its own session and process group, so it is stopped as a group, and the
  kernel SIGTERMs it when the node dies, even by SIGKILL;
- its output reaches its log file only through this process, which checks the fence before every
  write: a node that was paused and replaced adds nothing to its children's logs once it wakes
  (docs/design.md §5 rule 7).

Children must be started from the thread that lives as long as the node (the main thread): the
kernel sends the parent-death signal when that thread ends."""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from coordination.config import CoordinationConfig
from coordination.exhaustion import naming
from coordination.records import ensure_dir, fence_noticed, open_own

log = logging.getLogger("baton.children")

SHIM = str(Path(__file__).with_name("exec_shim.py"))
# coordination.child_start_timeout's default, for callers without a config; the shim needs about
# 20 ms on an idle node.
START_TIMEOUT = CoordinationConfig.child_start_timeout


class ChildFailed(RuntimeError):
    """The child exited non-zero, could not start, or was stopped because a peer was lost."""


class ChildStartError(ChildFailed):
    """The child was not running its command within the launch bound, or could not exec it."""


class Child:
    """A started child: its process (the group leader) and the thread that copies its output into
    its log file. `log_start` is the offset where this launch's output begins in that file."""

    def __init__(self, proc: subprocess.Popen, log_file: Path, log_start: int, pump: threading.Thread):
        self.proc = proc
        self.log_file = log_file
        self.log_start = log_start
        self._pump = pump

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the child's group (`stop_group`) and let its output reach the log."""
        stop_group(self.proc, timeout)
        self.join_output()

    def join_output(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the output of the exited group to be copied; a grandchild that left the
        group may still hold the pipe, and the copy then goes on in the background."""
        self._pump.join(timeout)


def start_child(argv: Sequence[str], *, env: dict[str, str], log_file: Path, what: str,
                start_timeout: float = START_TIMEOUT) -> Child:
    """Start `argv` as described in the module docstring; its output is appended to `log_file`
    after a header line naming `what` and the command. Raises ChildStartError (the command named)
    when it cannot start within `start_timeout` seconds."""
    argv = [str(a) for a in argv]
    ensure_dir(Path(log_file).parent)
    out = open_own(log_file, "ab")  # before anything starts: a fenced node or a planted link refuses here
    try:
        with naming(log_file):  # a full disk here is named by its file (coordination/exhaustion.py)
            out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {' '.join(argv)}\n".encode())
            out.flush()
        log_start = out.tell()
        proc, output = _spawn(argv, env, what, start_timeout)
    except BaseException:
        out.close()
        raise
    pump = threading.Thread(target=_copy_output, args=(output, out, log_file, what),
                            name=f"output of {what}", daemon=True)
    pump.start()
    return Child(proc, Path(log_file), log_start, pump)


def _spawn(argv: list[str], env: dict[str, str], what: str, timeout: float) -> tuple[subprocess.Popen, int]:
    """Fork+exec (in C) the shim with a pipe for the child's output and one that closes when the
    shim has exec'd the command; returns the process and the read end of its output."""
    status_r, status_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", SHIM, str(os.getpid()), str(status_w), "--", *argv],
                                env=env, stdin=subprocess.DEVNULL, stdout=out_w, stderr=subprocess.STDOUT,
                                pass_fds=(status_w,), start_new_session=True)
    except OSError as exc:
        for fd in (status_r, status_w, out_r, out_w):
            os.close(fd)
        raise ChildStartError(f"cannot start {what}: {exc} (Python {sys.executable}); command: {' '.join(argv)}") \
            from exc
    os.close(status_w)
    os.close(out_w)
    try:
        failure = _await_exec(status_r, timeout)
    finally:
        os.close(status_r)
    if failure is None:
        return proc, out_r
    _kill_group(proc)
    os.close(out_r)
    if failure == "":
        reason = (f"did not start within coordination.child_start_timeout = {timeout:g} s (the launch never "
                  f"reached exec; the node may be overloaded, or raise the bound)")
    else:
        reason = f"could not start: {failure}"
    raise ChildStartError(f"{what} {reason}; command: {' '.join(argv)}")


def _await_exec(fd: int, timeout: float) -> str | None:
    """None once `fd` closes with nothing written (the exec happened); the shim's message if it
    wrote one; "" if neither happened within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    message = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return ""
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return message.decode(errors="replace") if message else None
        message += chunk


def _copy_output(fd: int, out, log_file: Path, what: str) -> None:
    """Copy the child's output into its log file until every writer closed the pipe. Nothing is
    written once this node is fenced (the fence is probed at most once a second, so a node woken
    from a pause notices before its first write); what comes then is read and dropped so the
    child never blocks on a full pipe."""
    failed = False
    try:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except InterruptedError:
                continue
            if not chunk:
                return
            if failed or fence_noticed(max_age=1.0):
                continue
            try:
                out.write(chunk)
                out.flush()
            except OSError as exc:
                failed = True  # the child meets the same filesystem and reports it; say it once here
                log.warning("the output of %s can no longer be written to %s (%s); dropping the rest",
                            what, log_file, exc)
    finally:
        os.close(fd)
        try:
            out.close()
        except OSError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not exit within 10 s of SIGKILL (uninterruptible sleep, e.g. a hung "
                    "filesystem?); leaving it to init", proc.pid)


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the child's process group, wait, then SIGKILL; returns when the child is reaped
    (at most 10 s after the SIGKILL: a process in uninterruptible sleep is reported, not waited for)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc)  # stragglers of the group (torchrun's workers)
