"""Logging with a rank/role prefix on every line (several ranks often share one
console or file, and every line must say whose it is).

`setup("rank1 worker", log_file)` sends records to stderr and, when given, to a log file of the
rank under logs/<job>/rank-R/. Everything else calls `logging.getLogger("baton.<area>")`.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

_FMT = "%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s"


class _RankLogFile(logging.FileHandler):
    """The rank's log file. Never opened through a link planted in the run folder, and silent
    once this process knows it was superseded (docs/design.md §5 rule 7: a fenced process writes
    nothing under the log path; its last words go to stderr). Probes the fence at most once a
    second, so a process woken from a pause stops at once."""

    def _open(self):
        from coordination.records import open_own

        return open_own(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors)

    def emit(self, record: logging.LogRecord) -> None:
        from coordination.records import fence_noticed

        if not fence_noticed(max_age=1.0):
            super().emit(record)


class _Prefix(logging.Formatter):
    def __init__(self, prefix: str):
        super().__init__(_FMT.format(prefix=prefix), datefmt="%H:%M:%S")


def setup(prefix: str, log_file: Path | None = None, level: int = logging.INFO) -> logging.Logger:
    """Configure the `baton` logger for this process. Safe to call again (replaces handlers)."""
    root = logging.getLogger("baton")
    root.setLevel(level)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(_Prefix(prefix))
    root.addHandler(stream)
    if log_file is not None:
        fh = _RankLogFile(log_file)
        fh.setFormatter(_Prefix(prefix))
        root.addHandler(fh)
    return root


def get(name: str) -> logging.Logger:
    return logging.getLogger(f"baton.{name}")
