"""Small tmpfs mounts for tests of a full disk: a filesystem of a known size that a test can fill
to the byte and free again, without touching the machine's own disks."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")


@contextlib.contextmanager
def mounted(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `path` (mode 0750, as a run folder wants), unmounted on the way out even
    when the test failed; a lazy unmount when a process still holds a file there."""
    need_root()
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "tmpfs", str(path)],
                   check=True, capture_output=True, timeout=30)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True, capture_output=True, timeout=30)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(mount: Path, leave: int = 0) -> Path:
    """Fill the tmpfs at `mount` until at most `leave` bytes are free; returns the filler file.
    What the filler cannot take (the last partial page) is left too."""
    filler = mount / "filler"
    with open(filler, "ab") as fh:
        want = free_bytes(mount) - leave
        block = b"\0" * (1 << 20)
        try:
            while want > 0:
                fh.write(block[:min(want, len(block))])
                fh.flush()
                want -= min(want, len(block))
        except OSError:
            pass  # full: that was the point
    return filler
