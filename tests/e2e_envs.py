"""Environments for tests: passed as factories, or plugged into a run by
`tasks.env=tests.e2e_envs:SlowGuess`."""
from __future__ import annotations

import time

from rollout.envs import Step
from rollout.envs.guess import Guess

STEP_S = 0.1


class SlowGuess(Guess):
    """`guess` whose every answer takes STEP_S seconds, like a remote tool: a rank's rollout then
    lasts long enough that a kill after its first chunk lands while episodes are in flight."""

    def step(self, text: str):
        time.sleep(STEP_S)
        return super().step(text)


class Talk:
    """Answers every turn with `again K` and a step reward of 0.25; done after the task's `turns`
    (3 when the task names none)."""

    def __init__(self, task):
        self.task, self.n = task, 0

    def reset(self):
        return [{"role": "user", "content": self.task["prompt"]}]

    def step(self, text):
        self.n += 1
        return Step([{"role": "user", "content": f"again {self.n}"}], 0.25, self.n >= self.task.get("turns", 3))
