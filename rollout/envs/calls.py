"""Environment calls on worker threads, each with a deadline (docs/design.md §7).

Each call (factory, reset, step, close) runs on its own daemon thread and hands its result to a
Future, so the rollout loop can go on generating for other episodes while it runs and give up
on it at its deadline. A thread cannot be killed: a call past its deadline is abandoned and
runs on (a daemon, so it never delays the process's exit); more than `max_abandoned` of them
alive at once means the environment hangs rather than runs long, and the rollout fails saying so.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable

from rollout.chunks import RolloutError


class EnvHangs(RolloutError):
    """Too many abandoned environment calls are still running."""


class EnvCalls:
    def __init__(self, timeout: float, max_abandoned: int = 64):
        if not timeout > 0:
            raise ValueError(f"env_step_timeout must be positive (got {timeout!r})")
        self.timeout, self.max_abandoned = timeout, max_abandoned
        self._abandoned: list[threading.Thread] = []
        self._threads: dict[int, threading.Thread] = {}

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        alive = [t for t in self._abandoned if t.is_alive()]
        self._abandoned = alive
        if len(alive) > self.max_abandoned:
            raise EnvHangs(f"{len(alive)} environment calls ran past rollout.env_step_timeout={self.timeout:g} s "
                           f"and are still running: the environment hangs; fix it (or raise the timeout if it "
                           f"is only slow)")
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the episode, which records it
                fut.set_exception(exc)

        thread = threading.Thread(target=run, name="env call", daemon=True)
        self._threads[id(fut)] = thread
        fut.add_done_callback(lambda f: self._threads.pop(id(f), None))
        thread.start()
        return fut

    def abandon(self, fut: Future) -> None:
        """Give up on a call past its deadline; its thread is counted until it returns."""
        thread = self._threads.pop(id(fut), None)
        if thread is not None:
            self._abandoned.append(thread)
