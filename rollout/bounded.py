"""User code with a time limit per call (rewards now; environments and judges use the same).

A thread cannot be killed in Python, and a call into user code cannot be interrupted from
outside: a reward stuck in `time.sleep`, a socket read or a C extension never sees a flag. So
each call runs on a worker thread and the caller waits for it at most `timeout` seconds. A call
that runs past that is abandoned: the caller gets `CallTimedOut` and goes on, and the worker,
still inside the call, is left behind (a daemon thread, so it never delays the process's exit)
and replaced by a fresh one for the next call. What an abandoned call holds (CPU if it spins,
memory, a lock, an open file) stays held until it returns or the process ends; at most
`max_abandoned` such calls may be running at once, beyond that the next call raises
`TooManyStuck` instead of starting yet another thread (docs/design.md §7).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class CallTimedOut(RuntimeError):
    """One call ran past the time limit; its thread was abandoned."""


class TooManyStuck(RuntimeError):
    """Too many abandoned calls are still running: the function hangs, it does not merely run long."""


class _Worker:
    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:  # abandoned: its late result went to nobody, and no call comes after it
                return
            fn, args, done = job
            try:
                done.put((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who decides
                done.put((False, exc))


class BoundedCaller:
    """Calls `fn(*args)` on a worker thread and waits at most `timeout` seconds for the result.
    Not for concurrent use by several threads (one rollout worker calls it)."""

    def __init__(self, name: str, timeout: float, max_abandoned: int = 4):
        if not timeout > 0:
            raise ValueError(f"timeout must be positive (got {timeout!r})")
        self.name, self.timeout, self.max_abandoned = name, timeout, max_abandoned
        self._worker: _Worker | None = None
        self._abandoned: list[threading.Thread] = []

    def stuck(self) -> int:
        """Abandoned calls still running."""
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.stuck() >= self.max_abandoned:
            raise TooManyStuck(f"{self.name}: {len(self._abandoned)} earlier calls ran past {self.timeout:g} s and "
                               f"are still running")
        if self._worker is None:
            self._worker = _Worker(f"{self.name} calls")
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._worker.jobs.put((fn, args, done))
        try:
            ok, value = done.get(timeout=self.timeout)
        except queue.Empty:
            self._abandoned.append(self._worker.thread)
            self._worker.jobs.put(None)
            self._worker = None  # busy for good, as far as we know: the next call gets a fresh thread
            raise CallTimedOut(f"{self.name} did not return within {self.timeout:g} s") from None
        if not ok:
            raise value
        return value
