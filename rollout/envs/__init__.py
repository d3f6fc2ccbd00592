"""Environments: what a multi-turn episode talks to (docs/design.md §7).

An environment is plain Python, built once per episode by the factory that `tasks.env` names
(`module:factory`, or a built-in name such as `calculator`):

    env = factory(task)                  # task: the Task (mapping access: task["id"], task["answer"], ...)
    messages = env.reset()               # the first messages: [{"role": ..., "content": ...}, ...]
    step = env.step(assistant_text)      # Step(messages, reward, done) or a (messages, reward, done) tuple
    env.close()                          # optional; called once when the episode ends, whatever the reason

`messages` of a step are the observation (possibly empty), `reward` a number or None, `done` a
bool. The rollout worker runs the factory, reset, step and close on worker threads, each bounded
by `rollout.env_step_timeout` (rollout/envs/calls.py), so a slow environment does not hold up
the generation of other episodes and a hanging one ends its own episode only.
"""
from __future__ import annotations

import importlib
import math
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any, Callable

BUILTIN = {"calculator": "rollout.envs.calculator:Calculator", "guess": "rollout.envs.guess:Guess",
           "web": "rollout.envs.web:Web"}


class EnvError(ValueError):
    """`tasks.env` cannot be loaded, or an environment returned something of the wrong type; the
    message names the spec or the method and what was expected."""


@dataclass(frozen=True)
class Step:
    """What one `step` gives back: the observation messages (may be empty), a reward or None, done."""

    messages: list[dict[str, str]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


def check_messages(value: Any, where: str) -> list[dict[str, str]]:
    """`value` as a list of {"role", "content"} string messages, or EnvError naming `where`."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise EnvError(f"{where} returned messages of type {type(value).__name__}; return a list of "
                       f"{{'role': str, 'content': str}} dicts")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise EnvError(f"{where} returned messages[{i}] = {m!r}; each message must be a dict with string "
                           f"'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def check_step(value: Any, where: str = "step()") -> Step:
    """A step's return value, checked: a Step or a (messages, reward, done) tuple."""
    if isinstance(value, tuple) and len(value) == 3:
        value = Step(*value)
    if not isinstance(value, Step):
        raise EnvError(f"{where} returned {type(value).__name__} {value!r:.80}; return a rollout.envs.Step or a "
                       f"(messages, reward, done) tuple")
    reward = value.reward
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise EnvError(f"{where} returned reward {reward!r}; a reward is a finite number or None")
    if not isinstance(value.done, bool):
        raise EnvError(f"{where} returned done={value.done!r}; done must be True or False")
    return Step(check_messages(value.messages, where), None if reward is None else float(reward), value.done)


EnvFactory = Callable[[Any], Any]


def load_env(spec: str) -> EnvFactory:
    """The factory `tasks.env` names: a built-in name or `package.module:callable`."""
    path = BUILTIN.get(spec, spec)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EnvError(f"tasks.env={spec!r} is neither a built-in environment ({', '.join(BUILTIN)}) nor "
                       f"'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvError(f"tasks.env={spec!r}: cannot import module {module_name!r} ({exc}); make it importable "
                       f"(on PYTHONPATH on every node) or fix the name") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EnvError(f"tasks.env={spec!r}: module {module_name!r} has no callable {attr!r}; name a class or "
                       f"function that takes the task and returns an environment")
    return factory


def check_env(spec: str, task: Any, timeout: float) -> EnvFactory:
    """Load `tasks.env`, build its environment for one sample task and run one `reset()`, each
    within `timeout` seconds, before a run writes anything: an environment that does not load,
    raises, hangs or gives no first messages is found at the start (exit 2), not in iteration 1."""
    from rollout.envs.calls import EnvCalls

    factory = load_env(spec)
    calls = EnvCalls(timeout)
    fix = "fix the environment (or raise rollout.env_step_timeout if it is only slow)"
    built: list = []

    def start() -> Any:
        built.append(factory(task))
        return built[0].reset()

    fut = calls.submit(start)
    if not wait([fut], timeout=timeout).done:
        calls.abandon(fut)
        raise EnvError(f"tasks.env={spec!r}: building the environment and reset() on task {task['id']!r} did not "
                       f"return within {timeout:g} s (rollout.env_step_timeout); {fix}")
    try:
        messages = check_messages(fut.result(), f"tasks.env={spec!r} reset()")
    except EnvError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the user's environment is reported as input
        raise EnvError(f"tasks.env={spec!r} raised {type(exc).__name__}: {exc} when built and reset on task "
                       f"{task['id']!r}; {fix}") from None
    finally:
        if built and callable(getattr(built[0], "close", None)):
            calls.submit(built[0].close)
    if not messages:
        raise EnvError(f"tasks.env={spec!r}: reset() gave no messages on task {task['id']!r}; it must return the "
                       f"first messages of the episode")
    return factory
