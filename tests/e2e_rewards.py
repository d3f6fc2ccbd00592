"""A reward for end-to-end tests, plugged in by `tasks.reward=tests.e2e_rewards:starts_with_digit`.

A random tiny model almost never solves arithmetic, so every group would score zero and the
trainer would have nothing to learn from. This reward is 1 when the completion starts with a
digit, which a random character model does about one time in ten: groups get mixed rewards,
advantages are non-zero and training really runs. It also exercises user reward plugins."""
from __future__ import annotations


def starts_with_digit(task, completion_text: str, finish_reason: str) -> float:
    return 1.0 if completion_text[:1].isdigit() else 0.0


# Broken rewards for the input checks at join (tests/test_inputs_at_join.py).
def raises(task, completion_text: str, finish_reason: str) -> float:
    raise KeyError("score")


def returns_text(task, completion_text: str, finish_reason: str) -> float:
    return "1.0"


def returns_nan(task, completion_text: str, finish_reason: str) -> float:
    return float("nan")


def hangs(task, completion_text: str, finish_reason: str) -> float:
    import threading

    threading.Event().wait()  # never returns: the start check must give up on it after tasks.reward_timeout
    return 1.0
