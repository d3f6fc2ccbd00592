"""How an episode's reward is made of its parts (docs/design.md §7).

An episode that ended for its own reasons (done, max_turns, max_tokens) gets up to three named
parts, each recorded in its row (`reward_parts`), and its reward is their sum:

- "env": the environment's step rewards (episodes with `tasks.env`), combined by
  `tasks.env_reward`: "sum" of every reward a step gave, the "last" reward a step gave (0 when
  none did), or "none" (no env part);
- "reward": `tasks.reward` on the whole episode: always for single-turn tasks (the one-turn
  episode's completion), and with an environment when `tasks.reward_with_env` is set. The
  function gets the task, the last policy turn's text and finish_reason, and, if it has a
  parameter named `messages`, every message of the episode (rollout/rewards.py);
- "judge": the LLM judge's score of the episode (`tasks.judge`, rollout/judge/).

An episode that failed (env_error, timeout, judge_error) or sampled no turn has no parts and
reward 0; a failed one keeps its group out of training.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rollout.config import ENV_REWARDS


def env_part(step_rewards: Sequence[float], mode: str) -> float | None:
    """The "env" part of `step_rewards` (the rewards steps gave, in order) under `tasks.env_reward`."""
    if mode not in ENV_REWARDS:
        raise ValueError(f"tasks.env_reward={mode!r} is not one of {', '.join(ENV_REWARDS)}")
    if mode == "none":
        return None
    if mode == "last":
        return float(step_rewards[-1]) if step_rewards else 0.0
    return float(sum(step_rewards))


@dataclass(frozen=True)
class Scoring:
    """Which parts score an episode beside `tasks.reward` of single-turn tasks: the env part's
    mode, whether `tasks.reward` also scores environment episodes, and the judge (or None)."""

    env_reward: str = "sum"
    reward_with_env: bool = False
    judge: Any = None  # rollout.judge.Judge

    def __post_init__(self) -> None:
        if self.env_reward not in ENV_REWARDS:
            raise ValueError(f"tasks.env_reward={self.env_reward!r} is not one of {', '.join(ENV_REWARDS)}")

    @classmethod
    def of(cls, tasks: Any, judge: Any = None) -> "Scoring":
        """The scoring a `tasks` config section asks for, with the judge built from it (or None)."""
        return cls(tasks.env_reward, tasks.reward_with_env, judge)
