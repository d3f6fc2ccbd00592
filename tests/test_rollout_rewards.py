"""Reward parsing on tricky completions and loading of custom reward functions."""
from __future__ import annotations

import sys

import pytest

from rollout.rewards import RewardError, last_boxed, load_reward, math_answers_equal
from rollout.tasks import Task

ARITH = Task(id="a", prompt="123+456=", answer="579")


@pytest.mark.parametrize("text, finish, reward", [
    ("579", "stop", 1.0),
    (" 579\n", "stop", 1.0),
    ("+579", "stop", 1.0),
    ("579", "length", 0.0),          # no EOS: the model did not stop after its answer
    ("5790", "stop", 0.0),
    ("57", "stop", 0.0),
    ("579 ", "length", 0.0),
    ("579=579", "stop", 0.0),
    ("", "stop", 0.0),
    ("5 79", "stop", 0.0),
])
def test_arithmetic_reward_needs_exact_answer_and_eos(text, finish, reward):
    assert load_reward("arithmetic")(ARITH, text, finish) == reward


def test_arithmetic_reward_handles_negative_answers_and_dict_tasks():
    fn = load_reward("arithmetic")
    assert fn({"id": "n", "answer": "-61"}, "-61", "stop") == 1.0
    assert fn({"id": "n", "answer": "-61"}, "61", "stop") == 0.0


MATH = Task(id="m", prompt="?", answer="Natalia sold 48 + 24 = 72 clips.\n#### 72")


@pytest.mark.parametrize("text, finish, reward", [
    ("so the answer is \\boxed{72}.", "stop", 1.0),
    ("first 48, then 24, \\boxed{72} and 100 more words", "stop", 1.0),   # boxed wins over the last number
    ("I think \\boxed{70}, no wait \\boxed{72}", "stop", 1.0),             # the last box counts
    ("\\boxed{72} but actually \\boxed{7", "length", 1.0),                  # a cut box is skipped
    ("She sold 72 clips.", "stop", 1.0),
    ("She sold 72 clips and then 3", "stop", 0.0),                          # last number is 3
    ("She sold 72 clips", "length", 0.0),                                   # truncated: no fallback
    ("\\boxed{72}", "length", 1.0),
    ("\\boxed{72.0}", "stop", 1.0),
    ("\\boxed{\\$72}", "stop", 0.0),
    ("$\\boxed{ 72 }$", "stop", 1.0),
    ("no number here", "stop", 0.0),
])
def test_math_reward_extracts_the_final_answer(text, finish, reward):
    assert load_reward("math")(MATH, text, finish) == reward


@pytest.mark.parametrize("a, b, equal", [
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{3}{4}", "3/4", True),
    ("\\frac12", "1/2", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("1,234", "1234", True),
    ("x = 5", "5", True),
    ("50\\%", "50", True),
    ("\\text{10}", "10", True),
    ("\\sqrt{2}", "\\sqrt{2}", True),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("0.33", "\\frac{1}{3}", False),
    ("", "0", False),
])
def test_math_answer_normalisation(a, b, equal):
    assert math_answers_equal(a, b) is equal


def test_last_boxed_balances_nested_braces():
    assert last_boxed("x \\boxed{\\frac{1}{\\sqrt{2}}} y") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\fbox{3}") == "3"
    assert last_boxed("none") is None


def test_custom_reward_loaded_by_module_and_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(task, completion_text, finish_reason):\n"
        "    return len(completion_text) / 10 + (task['answer'] == 'x')\n"
        "def bad_value(task, completion_text, finish_reason):\n"
        "    return 'yes'\n"
        "def two_args(task, text):\n"
        "    return 1.0\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    fn = load_reward("my_rewards:length_bonus")
    assert fn(Task(id="t", prompt="p", answer="x"), "abcde", "stop") == 1.5
    with pytest.raises(RewardError, match=r"returned 'yes' for task 't'; a reward function must return a finite"):
        load_reward("my_rewards:bad_value")(Task(id="t", prompt="p", answer="x"), "", "stop")
    with pytest.raises(RewardError, match=r"my_rewards:two_args.*cannot be called as fn\(task, completion_text"):
        load_reward("my_rewards:two_args")
    with pytest.raises(RewardError, match=r"'NOT_CALLABLE' is a int, not a function"):
        load_reward("my_rewards:NOT_CALLABLE")
    with pytest.raises(RewardError, match=r"module 'my_rewards' has no attribute 'nope'"):
        load_reward("my_rewards:nope")


def test_unloadable_reward_specs_say_what_to_fix():
    with pytest.raises(RewardError, match=r"cannot import module 'no_such_module_xyz'.*importable"):
        load_reward("no_such_module_xyz:fn")
    with pytest.raises(RewardError, match=r"not a built-in reward \(arithmetic, math\)"):
        load_reward("exact")
    with pytest.raises(RewardError, match=r"package.module:function"):
        load_reward("mod:")
