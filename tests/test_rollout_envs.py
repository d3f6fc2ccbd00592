"""The environments that ship with baton: calculator (a tool call, then the answer) and guess
(higher/lower feedback), stepped as the rollout steps them and run on the tiny model; the README's
example environment; the start check that resets the environment once before a run writes anything."""
from __future__ import annotations

import re
import subprocess
import threading
import time

import pytest

from rollout.engine import Sampling
from rollout.engines.transformers_engine import TransformersEngine
from rollout.envs import EnvError, Step, check_env, check_step, load_env
from rollout.envs.calculator import evaluate
from rollout.episodes import Bounds
from rollout.rewards import load_reward
from rollout.tasks import Task, arithmetic_tasks, write_tasks
from rollout.worker import roll_groups
from tests.e2e import RUN_SH, weightless_model
from tests.procs import ROOT, env
from train.tiny import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_calculator_answers_a_tool_call_then_scores_the_answer():
    env = load_env("calculator")(Task("c1", "What is 17*23?", "391"))
    assert env.reset() == [{"role": "user", "content": "What is 17*23?"}]
    assert check_step(env.step("let me see <calc>17*23</calc>")) == Step([{"role": "tool", "content": "391"}], None,
                                                                         False)
    assert check_step(env.step("the answer is 391")) == Step([], 1.0, True)
    assert check_step(env.step("the answer is 390")) == Step([], 0.0, True)
    assert check_step(env.step("no number at all")) == Step([], 0.0, True)


@pytest.mark.parametrize("expression, result", [("17*23", "391"), ("(1+2)*-3", "-9"), ("7/2", "3.5"), ("8/4", "2"),
                                                ("1/0", "error: division by zero"),
                                                ("__import__('os')", "error: only numbers"),
                                                ("2**99", "error: only numbers"), ("1+", "error: cannot parse")])
def test_calculator_evaluates_arithmetic_only(expression, result):
    try:
        value = evaluate(expression)
    except ValueError as exc:
        value = f"error: {exc}"
    assert value.startswith(result)


def test_guess_gives_higher_or_lower_and_rewards_few_turns():
    env = load_env("guess")(Task("g1", "", "37", extra={"low": 1, "high": 64}))
    assert env.reset() == [{"role": "user", "content": "Guess my number from 1 to 64. Answer with a number."}]
    assert env.step("32") == Step([{"role": "user", "content": "higher"}], None, False)
    assert env.step("maybe") == Step([{"role": "user", "content": "Answer with a number."}], None, False)
    assert env.step("40 or so") == Step([{"role": "user", "content": "lower"}], None, False)
    assert env.step("37") == Step([], 0.25, True)
    with pytest.raises(ValueError, match=r"answer 99 is outside low..high = 1..64; fix the task"):
        load_env("guess")(Task("g2", "", "99", extra={"low": 1, "high": 64}))


@pytest.mark.parametrize("spec, task", [("calculator", Task("c", "What is 2+3?", "5")),
                                        ("guess", Task("g", "", "5", extra={"low": 1, "high": 9}))])
def test_shipped_environments_run_episodes_on_the_engine(tmp_path, spec, task):
    engine = TransformersEngine()
    engine.start(write_tiny_model(tmp_path / "model"))
    try:
        groups = roll_groups(engine, engine.tokenizer, [task], 4, Sampling(max_new_tokens=6, seed=3),
                             load_reward("arithmetic"), env_factory=load_env(spec), bounds=Bounds(3, 256, 30.0))
    finally:
        engine.stop()
    for e in groups[0].episodes:
        assert e.termination in ("done", "max_turns") and 1 <= e.turns <= 3
        assert 0.0 <= e.reward <= 1.0 and len(e.ids) == len(e.loss_mask) == len(e.logprobs)


def test_the_readme_environment_runs_as_written():
    source = re.search(r"```python\n(.*?class WordLadder.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert len(source.strip().splitlines()) <= 30
    scope: dict = {}
    exec(compile(source, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    env = scope["WordLadder"](Task("w", "", "cold", extra={"start": "cord"}))
    assert env.reset() == [{"role": "user", "content": "Change one letter at a time: cord -> cold."}]
    assert check_step(env.step("warm")) == Step([{"role": "user", "content": "'warm' is not one letter from cord."}],
                                                None, False)
    assert check_step(env.step("cold")) == Step([], 1.0, True)


class BrokenAtReset:
    def __init__(self, task):
        pass

    def reset(self):
        raise ConnectionError("the browser did not start")


@pytest.mark.parametrize("overrides, says", [
    (["tasks.env=tests.test_rollout_envs:BrokenAtReset"],
     r"tasks.env='tests.test_rollout_envs:BrokenAtReset' raised ConnectionError: the browser did not start when "
     r"built and reset on task 'train-000000'; fix the environment"),
    (["tasks.env=tests.no_such_env:Env"], r"tasks.env='tests.no_such_env:Env': cannot import module 'tests.no_such_env'"),
    (["tasks.env=calculator", "rollout.max_episode_tokens=4096"],
     r"rollout.max_episode_tokens=4096 is more than the model's 256 positions .*; set rollout.max_episode_tokens=256 "
     r"or lower"),
    (["tasks.env=calculator", "rollout.max_episode_tokens=256"], None),
])
def test_the_dry_run_resets_the_environment_once_and_refuses_a_broken_one_before_writing(tmp_path, overrides, says):
    data, model, log = tmp_path / "data", tmp_path / "model", tmp_path / "run"
    data.mkdir()
    train, ev = arithmetic_tasks(64, 8, digits=2, seed=1)
    write_tasks(data / "train.jsonl", train)
    write_tasks(data / "eval.jsonl", ev)
    weightless_model(model)
    cmd = [RUN_SH, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both", "--eval-interval", "0",
           "--dry-run", f"model.path={model}", *overrides]
    res = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert not log.exists()
    if says is None:
        assert res.returncode == 0, res.stdout + res.stderr
        return
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.search(says, " ".join(res.stderr.split())), res.stderr


class HangsAtReset:
    release = None

    def __init__(self, task):
        pass

    def reset(self):
        HangsAtReset.release.wait()


def test_the_start_check_gives_up_on_a_hanging_reset_at_the_timeout():
    HangsAtReset.release = threading.Event()
    t0 = time.monotonic()
    try:
        with pytest.raises(EnvError, match=r"tasks.env='tests.test_rollout_envs:HangsAtReset': building the "
                                           r"environment and reset\(\) on task 't' did not return within 0.5 s"):
            check_env("tests.test_rollout_envs:HangsAtReset", Task("t", "p", "1"), 0.5)
        assert time.monotonic() - t0 < 5
    finally:
        HangsAtReset.release.set()
