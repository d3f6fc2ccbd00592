"""Where a node's main thread is, for its heartbeat: a main thread that has stayed in one place
longer than `coordination.stuck_report_after` is named in the heartbeat message (so `status` shows
it) and in the log, with the frames it sits in (docs/design.md §9.1).

The heartbeat thread keeps beating whatever the main thread does, so without this a node blocked
for good in a system call (a launch, a hung filesystem) looks healthy to every observer.

"In one place" means: between two looks the main thread's stack (file, line and function of every
frame) did not change and no polling loop ticked. Every bounded wait of the protocol polls
(`Backoff.next`, `Clock.sleep`, a child's watch loop and the engines' waits call `tick`), so a node
that waits at a barrier for an hour is moving; a node inside one long call is not, and is
reported for what it is: where it has been for how long, not that it failed."""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Callable

log = logging.getLogger("baton.stall")

_MAIN = threading.main_thread().ident
_ticks = 0
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the repository


def tick() -> None:
    """A polling loop made one more round: the main thread is moving (called from any thread;
    only the main thread's rounds count)."""
    global _ticks
    if threading.get_ident() == _MAIN:
        _ticks += 1


def _stack() -> tuple[tuple[str, int, str], ...]:
    frame = sys._current_frames().get(_MAIN)
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(out)  # innermost first


def where(stack: tuple[tuple[str, int, str], ...], project_frames: int = 2) -> str:
    """The innermost frame and the innermost `project_frames` frames of baton's own code:
    "subprocess.py:1955 _execute_child <- train/resident.py:78 launch <- rl/driver.py:254 ..."."""
    picked = list(stack[:1])
    picked += [f for f in stack[1:] if f[0].startswith(_ROOT)][:project_frames]
    parts = []
    for path, line, func in picked:
        shown = path[len(_ROOT):] if path.startswith(_ROOT) else os.path.basename(path)
        parts.append(f"{shown}:{line} {func}")
    return " <- ".join(parts) or "(no Python frame)"


class MainThreadWatch:
    """Looked at by the heartbeat thread before each beat; `check()` returns the text to add to the
    heartbeat message while the main thread is stuck, else None. Logs a warning when a stall
    passes the bound and again every further bound."""

    def __init__(self, bound: float, monotonic: Callable[[], float]):
        self.bound = bound
        self.monotonic = monotonic
        self._key: tuple | None = None
        self._since = monotonic()
        self._next_warning = bound

    def check(self) -> str | None:
        now = self.monotonic()
        if threading.get_ident() == _MAIN:  # the main thread itself beats: it is not stuck
            self._key, self._since = None, now
            return None
        stack = _stack()
        key = (_ticks, stack)
        if key != self._key:
            self._key, self._since, self._next_warning = key, now, self.bound
            return None
        still = now - self._since
        if still < self.bound:
            return None
        text = f"main thread in one place for {still:.0f} s: {where(stack)}"
        if still >= self._next_warning:
            log.warning("%s (reported by the heartbeat thread; the node is alive but its main thread has not "
                        "moved for coordination.stuck_report_after = %g s)", text, self.bound)
            self._next_warning = still + self.bound
        return text
