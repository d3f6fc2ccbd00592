"""Reward functions: parse the final answer out of a completion and verify it (docs/design.md §7).

A reward function has the signature

    fn(task, completion_text: str, finish_reason: str) -> float

`task` is a `rollout.tasks.Task` (attributes id, prompt, answer, messages, extra; it also
supports `task["answer"]` and `task.get("key")` like a dict, so functions written for dicts
work). `completion_text` is the decoded completion without special tokens; `finish_reason` is
"stop" when the model emitted EOS and "length" when it hit `rollout.max_new_tokens`. Return a
finite number; 1.0 conventionally means solved (see `rollout.success_reward`). Each call of your
own function may take at most `tasks.reward_timeout` seconds (rollout/bounded.py): past it, the
start check refuses the reward (exit 2), and during a rollout the sample ends with finish_reason
"reward_timeout" and reward 0, counted in the rollout's stats and logged with the reason; its
group is not trained on.

A function that also has a parameter named `messages` is called with `messages=` the whole
episode as {"role", "content"} dicts: the first messages (the task's, or the environment's
`reset()`), then each policy turn (role "assistant", its decoded text) and each observation.
`completion_text` is then the text of the episode's last policy turn (rollout/scoring.py).

`tasks.reward` chooses one:
- "arithmetic": 1.0 iff the completion, stripped of surrounding whitespace, equals the answer
  (integers compare by value, so "+579" and "579" agree) AND finish_reason is "stop". Requiring
  EOS teaches the model to stop after the answer instead of rambling on to the token limit
  (part of the recipe that makes GRPO on the tiny model learn, docs/design.md §10.4).
- "math": the last `\\boxed{...}` in the completion, else its last number, compared with the
  task's answer (which may itself be `\\boxed{}` or GSM8K-style `... #### 42`) after LaTeX
  normalisation; numbers compare exactly as fractions (0.5 == 1/2 == \\frac{1}{2}). A boxed
  answer counts whatever the finish reason; the last-number fallback needs finish_reason
  "stop", since the last number of a truncated completion is merely where it was cut.
- "package.module:function": your own function with the signature above. It is imported on
  every node, so the module must be importable there (run.sh runs from the repository root).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import math
import re
from fractions import Fraction
from typing import Any, Callable, Mapping, Union

from rollout.bounded import BoundedCaller, CallTimedOut, TooManyStuck
from rollout.config import TasksConfig
from rollout.tasks import Task

RewardFn = Callable[[Union[Task, Mapping[str, Any]], str, str], float]


class RewardError(ValueError):
    """A reward spec that cannot be loaded, or a reward function that misbehaved."""


def _answer(task: Task | Mapping[str, Any]) -> str:
    value = task["answer"]
    return value if isinstance(value, str) else str(value)


# -- arithmetic -------------------------------------------------------------------------------

_INT_RE = re.compile(r"^[+-]?\d+$")


def normalise_arithmetic(text: str) -> str:
    text = text.strip()
    if _INT_RE.match(text):
        return str(int(text))
    return text


def arithmetic_reward(task: Task | Mapping[str, Any], completion_text: str, finish_reason: str) -> float:
    if finish_reason != "stop":
        return 0.0
    return 1.0 if normalise_arithmetic(completion_text) == normalise_arithmetic(_answer(task)) else 0.0


# -- math -------------------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
_FRAC_RE = re.compile(r"^([-+]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_SIMPLE_FRAC_RE = re.compile(r"^([-+]?)\\frac(\d)(\d)$")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (braces balanced) or `\\boxed x`; None if there is none."""
    matches = list(_BOXED_RE.finditer(text))
    for m in reversed(matches):
        i = m.end()
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j]
            continue  # unbalanced (truncated) box: try an earlier one
        word = re.match(r"[^\s$]+", text[i:])
        if word:
            return word.group(0)
    return None


def last_number(text: str) -> str | None:
    found = _NUMBER_RE.findall(text)
    return found[-1] if found else None


def normalise_math(text: str) -> str:
    s = text.strip()
    s = _TEXT_RE.sub(r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%",
                  "\\displaystyle"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"^[a-zA-Z]=", "", s)  # "x=5" -> "5"
    s = s.rstrip(".")
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def as_number(s: str) -> Fraction | None:
    """Exact value of a normalised numeric answer (integer, decimal, a/b, \\frac{a}{b}); else None."""
    m = _FRAC_RE.match(s) or _SIMPLE_FRAC_RE.match(s)
    if m:
        num, den = as_number(m.group(2)), as_number(m.group(3))
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if m.group(1) == "-" else value
    if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)", s):
        return Fraction(s)
    if re.fullmatch(r"[-+]?\d+(\.\d+)?/\d+(\.\d+)?", s):
        num, den = s.split("/")
        return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
    return None


def math_answers_equal(predicted: str, reference: str) -> bool:
    p, r = normalise_math(predicted), normalise_math(reference)
    if not p:
        return False
    pn, rn = as_number(p), as_number(r)
    if pn is not None and rn is not None:
        return pn == rn
    return p == r


def reference_answer(answer: str) -> str:
    """The final answer of a reference solution: after `####` (GSM8K), inside `\\boxed{}`, or all of it."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = last_boxed(answer)
    return boxed if boxed is not None else answer


def math_reward(task: Task | Mapping[str, Any], completion_text: str, finish_reason: str) -> float:
    predicted = last_boxed(completion_text)
    if predicted is None:
        if finish_reason != "stop":
            return 0.0
        predicted = last_number(completion_text)
        if predicted is None:
            return 0.0
    return 1.0 if math_answers_equal(predicted, reference_answer(_answer(task))) else 0.0


BUILTIN: dict[str, RewardFn] = {"arithmetic": arithmetic_reward, "math": math_reward}


# -- loading ----------------------------------------------------------------------------------

class RewardTimeout(RewardError):
    """One call of the reward ran past `tasks.reward_timeout`; the sample it scored gets no reward."""


# Default of `tasks.reward_timeout` for callers without a run config (SFT's eval, tests).
REWARD_TIMEOUT = TasksConfig.reward_timeout
TIMED_OUT = "reward_timeout"  # the finish_reason of a sample whose reward ran past the limit


class CheckedReward:
    """A reward function plus its spec; each call of a user's function is bounded by `timeout`
    seconds (rollout/bounded.py), and every result is checked to be a finite number."""

    def __init__(self, spec: str, fn: RewardFn, timeout: float = REWARD_TIMEOUT):
        self.spec = spec
        self.fn = fn
        self.timeout = timeout
        # The built-in rewards are baton's own code on a completion of bounded length: the thread
        # hand-off (16-63 us a call against 1.5-7 us direct on 2 shared cores, up to 0.5 s of an
        # 8192-sample iteration) buys nothing there.
        self._caller = None if BUILTIN.get(spec) is fn else BoundedCaller(f"reward {spec!r}", timeout)
        self.takes_messages = _has_parameter(fn, "messages")

    def __call__(self, task: Task | Mapping[str, Any], completion_text: str, finish_reason: str,
                 messages: list[dict[str, str]] | None = None) -> float:
        task_id = task["id"]
        args: tuple = (task, completion_text, finish_reason)
        fn = self.fn
        if self.takes_messages:
            # A caller without an episode (SFT's eval, the start check) scored one completion of the task.
            if messages is None:
                messages = [{"role": "user", "content": task["prompt"]}, {"role": "assistant", "content": completion_text}]
            fn = functools.partial(self.fn, messages=messages)
        try:
            value = fn(*args) if self._caller is None else self._caller(fn, *args)
        except CallTimedOut:
            raise RewardTimeout(f"reward {self.spec!r} did not return within {self.timeout:g} s "
                                f"(tasks.reward_timeout) on task {task_id!r}") from None
        except TooManyStuck as exc:
            raise RewardError(f"{exc}: the function hangs; fix it (or raise tasks.reward_timeout if it is only "
                              f"slow)") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward {self.spec!r} returned {value!r} for task {task_id!r}; "
                              f"a reward function must return a finite number (float)")
        return float(value)

    def __repr__(self) -> str:
        return f"CheckedReward({self.spec!r})"


def _has_parameter(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False  # builtins without a signature


def load_reward(spec: str, timeout: float = REWARD_TIMEOUT) -> RewardFn:
    """"arithmetic" | "math" | "package.module:function" -> a checked reward function whose calls
    last at most `timeout` seconds each."""
    if spec in BUILTIN:
        return CheckedReward(spec, BUILTIN[spec], timeout)
    if ":" not in spec:
        raise RewardError(f"tasks.reward={spec!r} is not a built-in reward ({', '.join(BUILTIN)}) nor "
                          f"'package.module:function'; pick one of those")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardError(f"tasks.reward={spec!r}: write it as 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"tasks.reward={spec!r}: cannot import module {module_name!r} ({exc}); make it importable "
                          f"on every node (for example put it in the repository or on PYTHONPATH)") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: name it
        raise RewardError(f"tasks.reward={spec!r}: importing module {module_name!r} failed: "
                          f"{type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"tasks.reward={spec!r}: module {module_name!r} has no attribute {attr!r}; "
                              f"check the function name after the ':'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(f"tasks.reward={spec!r}: {attr!r} is a {type(obj).__name__}, not a function; "
                          f"point at a function fn(task, completion_text, finish_reason) -> float")
    try:
        inspect.signature(obj).bind(None, "", "", **({"messages": []} if _has_parameter(obj, "messages") else {}))
    except TypeError:
        raise RewardError(f"tasks.reward={spec!r}: {attr} cannot be called as fn(task, completion_text, "
                          f"finish_reason) or fn(task, completion_text, finish_reason, messages); give it exactly "
                          f"those parameters") from None
    except ValueError:
        pass  # builtins without a signature: trust them
    return CheckedReward(spec, obj, timeout)


def check_reward(spec: str, task: Task, timeout: float = REWARD_TIMEOUT) -> RewardFn:
    """Load the reward and score one sample task (its own answer as the completion, and an empty
    truncated completion) before a run starts: a reward that does not load, raises, hangs past
    `timeout` or returns something other than a finite number is found at join, not at phase 1
    of the first iteration."""
    fn = load_reward(spec, timeout)
    for text, finish in ((task.answer, "stop"), ("", "length")):
        try:
            fn(task, text, finish)
        except RewardTimeout as exc:
            raise RewardError(f"{exc} at the start check (completion {text!r}, finish_reason {finish!r}); "
                              f"fix the function, or raise tasks.reward_timeout if it is only slow") from None
        except RewardError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the user's function is reported as input
            raise RewardError(f"tasks.reward={spec!r} raised {type(exc).__name__}: {exc} on task {task.id!r} "
                              f"(completion {text!r}, finish_reason {finish!r}); fix the function") from None
    return fn
