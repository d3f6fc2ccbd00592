"""Counts of filesystem metadata operations made while coordinating.

Shared filesystems serve metadata (open, stat, create, rename, readdir) from one server; a
protocol that hammers it slows every job on the cluster. The barrier and heartbeat code count
what they do here, so `python -m coordination.bench` can report operations per second per
waiting rank."""
from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

_lock = threading.Lock()
COUNTS: Counter = Counter()


def count(kind: str, n: int = 1) -> None:
    with _lock:
        COUNTS[kind] += n


def total() -> int:
    with _lock:
        return sum(COUNTS.values())


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(COUNTS)


def exists(path: Path) -> bool:
    count("stat")
    return os.path.exists(path)


def refresh_dir(path: Path) -> None:
    """List a directory so NFS clients revalidate their cached negative lookups in it."""
    count("readdir")
    try:
        os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
