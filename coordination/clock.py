"""Time sources and backoff. Everything that waits takes a `Clock`, so tests drive time with
`FakeClock` instead of sleeping."""
from __future__ import annotations

import threading
import time

from coordination.stall import tick


class Clock:
    """The real clock: monotonic time for deadlines and liveness, wall time only for display."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        tick()
        if seconds > 0:
            time.sleep(seconds)


class FakeClock(Clock):
    """A clock that only moves when someone sleeps on it or calls `advance` (tests)."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1.7e9):
        self._now = start
        self._wall_offset = wall_start - start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def wall(self) -> float:
        with self._lock:
            return self._now + self._wall_offset

    def sleep(self, seconds: float) -> None:
        self.advance(max(seconds, 0.0))

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class Backoff:
    """Polling delays that start at `lo` and grow by `factor` up to `hi` (docs/design.md §5 rule 5).

    A barrier released soon after a rank starts waiting is seen within tens of milliseconds,
    while a long wait costs about one probe per second."""

    def __init__(self, lo: float = 0.02, hi: float = 1.0, factor: float = 1.25):
        if not 0 < lo <= hi:
            raise ValueError(f"backoff needs 0 < lo <= hi (got lo={lo}, hi={hi})")
        self.lo, self.hi, self.factor = lo, hi, factor
        self._delay = lo

    def next(self) -> float:
        tick()  # every wait of the protocol polls through here: the main thread is moving
        d = self._delay
        self._delay = min(self._delay * self.factor, self.hi)
        return d

    def reset(self) -> None:
        self._delay = self.lo
