"""The LLM judge: scores whole episodes, in batches, with a bound on tries (docs/design.md §7).

`Judge.score(items)` renders `tasks.judge.template` for each (task, messages) pair, asks the
backend (a second engine on the node, rollout/judge/engine.py, or an OpenAI-compatible URL,
rollout/judge/http.py) for up to `batch_size` answers at a time, and parses each answer into a
score within [min_score, max_score]. A call that fails, times out or gives an answer without a
score is tried again, `attempts` tries in all; an episode still without a score gets a Verdict
with the error, which ends it as judge_error (rollout/episodes.py), counted against
`rollout.max_env_error_rate` like an environment error and quoted when that bound fails the phase.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from coordination import log
from rollout.judge.config import JudgeConfig
from rollout.rewards import as_number, last_number, normalise_math

_log = log.get("judge")


class JudgeError(ValueError):
    """`tasks.judge.parser` names a module or function that is not there."""


@dataclass(frozen=True)
class Failed:
    """One call that gave no answer, and why."""

    reason: str


@dataclass(frozen=True)
class Verdict:
    score: float = 0.0
    error: str = ""  # empty when the judge scored the episode


class Backend(Protocol):
    def ask(self, prompts: list[str], attempt: int) -> list[str | Failed]:
        """One answer (or why there is none) per prompt, each call bounded by the judge's timeout."""

    def close(self) -> None:
        """Stop what the backend started (threads, the second engine)."""


def render(template: str, task: Any, messages: Sequence[dict[str, str]]) -> str:
    """The judge's prompt for one episode."""
    answer = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    trajectory = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    return template.format(task=task["prompt"], trajectory=trajectory, answer=answer)


def last_number_score(text: str) -> float:
    """The last number of the judge's answer (integers, decimals, fractions)."""
    found = last_number(text)
    value = as_number(normalise_math(found)) if found is not None else None
    if value is None:
        raise ValueError("the answer holds no number")
    return float(value)


def load_parser(spec: str) -> Callable[[str], float]:
    """'last_number' or 'package.module:function' (text -> number)."""
    if spec == "last_number":
        return last_number_score
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr, None)
    except ImportError as exc:
        raise JudgeError(f"judge.parser={spec!r}: cannot import module {module_name!r} ({exc}); make it importable "
                         f"on every node") from None
    if not callable(fn):
        raise JudgeError(f"judge.parser={spec!r}: module {module_name!r} has no function {attr!r}; point at a "
                         f"function that takes the judge's answer text and returns a number")
    return fn


class Judge:
    def __init__(self, cfg: JudgeConfig, backend: Backend):
        self.cfg, self.backend = cfg, backend
        self.parse = load_parser(cfg.parser)
        self.failed = 0  # episodes that ended as judge_error
        self.calls = 0   # answers asked for, tries included

    def _score(self, answer: str) -> float:
        value = self.parse(answer)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"judge.parser {self.cfg.parser!r} returned {value!r}, not a finite number")
        return min(self.cfg.max_score, max(self.cfg.min_score, float(value)))

    def score(self, items: Sequence[tuple[Any, Sequence[dict[str, str]]]]) -> list[Verdict]:
        """A Verdict per (task, messages), in order."""
        prompts = [render(self.cfg.template, task, messages) for task, messages in items]
        scores: list[float | None] = [None] * len(prompts)
        last: list[str] = [""] * len(prompts)
        todo = list(range(len(prompts)))
        for attempt in range(self.cfg.attempts):
            for start in range(0, len(todo), self.cfg.batch_size):
                batch = todo[start:start + self.cfg.batch_size]
                answers = self.backend.ask([prompts[i] for i in batch], attempt)
                self.calls += len(batch)
                for i, answer in zip(batch, answers):
                    if isinstance(answer, Failed):
                        last[i] = answer.reason
                        continue
                    try:
                        scores[i] = self._score(answer)
                    except Exception as exc:  # noqa: BLE001 - a parser's failure is this answer's failure
                        last[i] = f"answer {answer[:120]!r}: {type(exc).__name__}: {exc}"
            todo = [i for i in todo if scores[i] is None]
            if not todo:
                break
        self.failed += len(todo)
        tries = f"{self.cfg.attempts} tr{'y' if self.cfg.attempts == 1 else 'ies'}"
        return [Verdict(s) if s is not None else Verdict(error=f"the judge gave no score in {tries} (tasks.judge."
                                                                  f"attempts); last: {last[i]}")
                for i, s in enumerate(scores)]

    def close(self) -> None:
        self.backend.close()
        _log.info("judge closed: %d answers asked for, %d episodes without a score", self.calls, self.failed)
