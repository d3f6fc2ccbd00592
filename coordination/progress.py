"""Progress of long work: a rich progress bar on a terminal, plain periodic log lines otherwise
(CI, nohup, log files). One class for rollouts, aggregation and training steps."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable

_log = logging.getLogger("baton.progress")


class Progress:
    """`with Progress("rollout train iter 3", total=500, unit="tasks") as p: p.advance(1, samples=8, tokens=96)`

    Rates of every extra counter passed to `advance` (samples, tokens ...) are shown per second.
    `interactive=None` picks the bar when stderr is a terminal."""

    def __init__(self, description: str, total: int, unit: str = "items", *, interval: float = 10.0,
                 interactive: bool | None = None, logger: logging.Logger = _log,
                 clock: Callable[[], float] = time.monotonic):
        self.description = description
        self.total = int(total)
        self.unit = unit
        self.interval = interval
        self.logger = logger
        self.clock = clock
        self.done = 0
        self.counters: dict[str, float] = {}
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self._start = clock()
        self._last_log = self._start
        self._bar = None
        self._task = None

    def __enter__(self) -> "Progress":
        if self.interactive:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn, TimeRemainingColumn)
            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rates]}"), TimeElapsedColumn(),
                                     TextColumn("ETA"), TimeRemainingColumn(), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, completed=self.done, rates="")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rates(self) -> dict[str, float]:
        elapsed = max(self.clock() - self._start, 1e-9)
        out = {f"{self.unit}/s": self.done / elapsed}
        out.update({f"{k}/s": v / elapsed for k, v in self.counters.items()})
        return out

    def eta(self) -> float | None:
        elapsed = self.clock() - self._start
        if self.done <= 0 or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / self.done

    def _rate_text(self) -> str:
        return "  ".join(f"{v:,.1f} {k}" for k, v in self.rates().items())

    def advance(self, n: int = 1, **counters: float) -> None:
        self.done += n
        for k, v in counters.items():
            self.counters[k] = self.counters.get(k, 0.0) + v
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, rates=self._rate_text())
            return
        now = self.clock()
        if now - self._last_log >= self.interval or self.done >= self.total:
            self._last_log = now
            eta = self.eta()
            self.logger.info("%s: %d/%d %s, %s, ETA %s", self.description, self.done, self.total, self.unit,
                             self._rate_text(), "-" if eta is None else f"{eta:.0f} s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
