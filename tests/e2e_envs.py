"""Environments for end-to-end tests, plugged in by `tasks.env=tests.e2e_envs:SlowGuess`."""
from __future__ import annotations

import time

from rollout.envs.guess import Guess

STEP_S = 0.1


class SlowGuess(Guess):
    """`guess` whose every answer takes STEP_S seconds, like a remote tool: a rank's rollout then
    lasts long enough that a kill after its first chunk lands while episodes are in flight."""

    def step(self, text: str):
        time.sleep(STEP_S)
        return super().step(text)
