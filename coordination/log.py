"""Logging with a rank/role prefix on every line (several ranks often share one
console or file, and every line must say whose it is).

`setup("rank1 worker", log_file)` sends records to stderr and, when given, to a log file of the
rank under logs/<job>/rank-R/. Everything else calls `logging.getLogger("baton.<area>")`.

A log file that cannot be written any more is dropped, not retried: records still reach the
console, without Python's "--- Logging error ---" blocks. When a full disk, a quota or a read-only
filesystem is why, `check()` ends the node from its main thread as any other write would
(coordination/exhaustion.py).
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from coordination.exhaustion import SHORTAGES, ResourceExhausted
from coordination.records import fence_noticed, open_own

_FMT = "%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s"

# `log.error(..., extra=FILE_ONLY)`: for the log file alone, such as the traceback of an ending the
# console states in one line.
FILE_ONLY = {"file_only": True}

_file_failure: tuple[int, str] | None = None  # (errno, path) of a log file lost to exhaustion


def _for_console(record: logging.LogRecord) -> bool:
    return not getattr(record, "file_only", False)


def check() -> None:
    """Raise ResourceExhausted (exit 8) when this process's log file was lost to a full disk, a
    quota, a read-only filesystem or the open-file limit: a node must not run on unrecorded. Called
    where the main thread checks its fence (waits, phase starts)."""
    if _file_failure is not None:
        raise ResourceExhausted(*_file_failure)


class _RankLogFile(logging.FileHandler):
    """The rank's log file. Never opened through a link planted in the run folder, and silent
    once this process knows it was superseded (docs/design.md §5 rule 7: a fenced process writes
    nothing under the log path; its last words go to stderr). Probes the fence at most once a
    second, so a process woken from a pause stops at once."""

    def _open(self):
        return open_own(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors)

    lost = False  # a write failed: this file is not written any more

    def emit(self, record: logging.LogRecord) -> None:
        if not self.lost and not fence_noticed(max_age=1.0):
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """Called by `emit` inside its `except`. An OSError (a full disk, a quota, EIO) drops the
        file: retrying every record would fail the same way and Python's default prints a traceback
        per record. The console handler already showed the record."""
        global _file_failure
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self.lost = True
        stream, self.stream = self.stream, None
        try:
            if stream is not None:
                stream.close()  # flushes the unwritten rest again: it fails the same way
        except OSError:
            pass
        if exc.errno in SHORTAGES:
            _file_failure = (exc.errno, self.baseFilename)  # check() ends the node with one line
        else:
            line = logging.LogRecord("baton.log", logging.WARNING, __file__, 0, "log file %s cannot be written (%s); "
                                     "this process logs to the console only from now on", (self.baseFilename, exc),
                                     None)
            sys.stderr.write(self.format(line) + "\n")


class _Prefix(logging.Formatter):
    def __init__(self, prefix: str):
        super().__init__(_FMT.format(prefix=prefix), datefmt="%H:%M:%S")


def setup(prefix: str, log_file: Path | None = None, level: int = logging.INFO) -> logging.Logger:
    """Configure the `baton` logger for this process. Safe to call again (replaces handlers, and
    forgets a log file lost before)."""
    global _file_failure
    _file_failure = None
    root = logging.getLogger("baton")
    root.setLevel(level)
    root.propagate = False
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(_Prefix(prefix))
    stream.addFilter(_for_console)
    root.addHandler(stream)
    if log_file is not None:
        fh = _RankLogFile(log_file)
        fh.setFormatter(_Prefix(prefix))
        root.addHandler(fh)
    return root


def get(name: str) -> logging.Logger:
    return logging.getLogger(f"baton.{name}")
