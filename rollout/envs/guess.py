"""The `guess` environment: find a number in a range from higher/lower feedback.

A task gives `answer` (the number) and optionally `low` and `high` (default 1 and 100). Each
policy turn's first integer is a guess; the environment answers `higher`, `lower`, or, for a
turn without a number, asks for one (a turn spent all the same). Finding the number ends the
episode with reward 1 / (turns used), so fewer turns score more; `rollout.max_turns` ends an
episode that never finds it (reward 0).
"""
from __future__ import annotations

import re
from typing import Any

from rollout.envs import Step

INTEGER = re.compile(r"-?\d+")


class Guess:
    def __init__(self, task: Any):
        self.low, self.high = int(task.get("low", 1)), int(task.get("high", 100))
        self.target = int(task["answer"])
        if not self.low <= self.target <= self.high:
            raise ValueError(f"task {task['id']!r}: answer {self.target} is outside low..high = "
                             f"{self.low}..{self.high}; fix the task")
        self.turns = 0

    def reset(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Guess my number from {self.low} to {self.high}. Answer with a number."}]

    def step(self, text: str) -> Step:
        self.turns += 1
        found = INTEGER.search(text)
        if found is None:
            return Step([{"role": "user", "content": "Answer with a number."}], None, False)
        guess = int(found.group())
        if guess == self.target:
            return Step([], 1.0 / self.turns, True)
        return Step([{"role": "user", "content": "higher" if guess < self.target else "lower"}], None, False)
