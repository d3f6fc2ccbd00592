"""Multi-turn episodes on the tiny model's transformers engine: token-exact sequences, every
termination reason, environments that raise, hang or return the wrong types, and the error rate."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from coordination.layout import RunLayout
from rollout import store
from rollout.chunks import RolloutError
from rollout.config import RolloutConfig
from rollout.engine import Sampling
from rollout.envs import EnvError, Step, load_env
from rollout.episodes import Bounds
from rollout.prompts import ObservationTokens, chat_ids
from rollout.rewards import load_reward
from rollout.tasks import Task
from rollout.worker import RolloutTarget, Sampler, roll_groups, rollout_rank, sampling_for
from tests.e2e_envs import Talk
from tests.test_vllm_lifecycle import checkpoint, make, stand_in  # noqa: F401 - fixtures of the stand-in server
from train.batches import collate

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REWARD = load_reward("arithmetic")
never = threading.Event()  # what a hanging environment waits for; set at module teardown


@pytest.fixture(scope="module")
def engine(tiny_engine):
    yield tiny_engine
    never.set()


class Recording:
    """The real engine, keeping every sample it returned (to compare with the episodes' ids)."""

    def __init__(self, inner):
        self.inner, self.name, self.rolling, self.samples = inner, "recording", False, []
        self.tokenizer = inner.tokenizer

    def generate(self, prompts, n, sampling):
        out = self.inner.generate(prompts, n, sampling)
        self.samples += [s for group in out for s in group]
        return out


class Raises(Talk):
    def step(self, text):
        raise RuntimeError("the tool is broken")


class WrongType(Talk):
    def step(self, text):
        return "a string, not a step"


class Hangs(Talk):
    def step(self, text):
        never.wait()


class Slow(Talk):
    returned = threading.Event()

    def step(self, text):
        time.sleep(2.0)
        Slow.returned.set()
        return Step([], 1.0, True)


def tasks(n, **extra):
    return [Task(id=f"t{i}", prompt=f"{i}+{i}=", answer=str(2 * i), extra=dict(extra)) for i in range(n)]


def run(engine, env, bounds=Bounds(8, 256, 30.0), n_tasks=3, group=2, **extra):
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=5)
    return roll_groups(engine, engine.tokenizer, tasks(n_tasks, **extra), group, sampling, REWARD, env_factory=env,
                       bounds=bounds)


def test_an_episode_is_the_sampled_ids_between_template_ids_and_the_trainer_recomputes_their_logprobs(engine):
    recording = Recording(engine)
    tok = engine.tokenizer
    groups = run(recording, Talk, n_tasks=4, group=3)
    episodes = [e for g in groups for e in g.episodes]
    assert len(episodes) == 12
    observation = ObservationTokens(tok)
    sampled = {tuple(s.token_ids) for s in recording.samples}
    for e in episodes:
        assert (e.termination, e.turns, e.step_rewards, e.reward_parts, e.reward) == (
            "done", 3, [0.25] * 3, {"env": 0.75}, 0.75)
        assert e.prompt_ids == chat_ids(tok, [{"role": "user", "content": e.task.prompt}], add_generation_prompt=True)
        ends = e.turn_starts[1:] + [len(e.ids)]
        for k, (start, end) in enumerate(zip(e.turn_starts, ends)):
            obs = observation([{"role": "user", "content": f"again {k + 1}"}]) if k < 2 else []
            turn = e.ids[start:end - len(obs)]
            # The turn's ids are a sample exactly as the engine returned it (an EOS inside the
            # episode could not come back from re-tokenizing text), then the observation's ids.
            assert tuple(turn) in sampled
            assert e.ids[end - len(obs):end] == obs
            assert e.loss_mask[start:end] == [1] * len(turn) + [0] * len(obs)
        assert tok.decode(e.ids, skip_special_tokens=True) == e.text
        assert "user: again 1\nassistant: " in e.text and "user: again 2\nassistant: " in e.text
    # Special tokens (EOS, BOS, pad, unk: a random model samples them) vanish from decoded text, so
    # one sent back inside the next turn's prompt proves the prompt was not text re-tokenized.
    special = set(tok.all_special_ids)
    assert any(special & set(e.ids[:e.turn_starts[-1]]) for e in episodes), "no special token before a last turn"

    batch = collate([{"prompt_ids": e.prompt_ids, "completion_ids": e.ids, "logprobs": e.logprobs,
                      "loss_mask": e.loss_mask} for e in episodes], engine.pad_id)
    with torch.no_grad():
        logits = engine.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    assert int(batch.loss_mask.sum()) == sum(sum(e.loss_mask) for e in episodes) == \
        sum(len(s.token_ids) for s in recording.samples)
    assert float(((logp - batch.old_logprobs).abs() * batch.loss_mask).max()) < 1e-4


@pytest.mark.parametrize("env, bounds, termination, error", [
    (Talk, Bounds(2, 256, 30.0), "max_turns", ""),
    (Talk, Bounds(50, 48, 30.0), "max_tokens", ""),
    (Raises, Bounds(8, 256, 30.0), "env_error", "step() raised RuntimeError: the tool is broken"),
    (WrongType, Bounds(8, 256, 30.0), "env_error", "step() returned str"),
    (Hangs, Bounds(8, 256, 0.5), "timeout", "step() did not return within rollout.env_step_timeout=0.5 s"),
])
def test_every_termination_reason_is_recorded_with_its_error(engine, env, bounds, termination, error):
    t0 = time.monotonic()
    episodes = [e for g in run(engine, env, bounds, turns=100) for e in g.episodes]
    assert time.monotonic() - t0 < 30  # a hanging step costs its timeout, not the whole run
    for e in episodes:
        assert e.termination == termination and e.error.startswith(error)
        assert e.turns >= 1
        if termination == "max_turns":
            assert e.turns == 2 and e.reward == 0.5
        if termination == "max_tokens":
            # No turn could run past the bound, and an observation no turn answers is not kept.
            assert e.length <= 48 and e.loss_mask[-1] == 1
        if termination in ("env_error", "timeout"):
            assert e.turns == 1 and e.reward == 0.0


class NoFirstMessages(Talk):
    def reset(self):
        return []


def refuses(task):
    raise KeyError("the task has no 'start' word")


@pytest.mark.parametrize("env, error", [
    (refuses, "the factory or reset() raised KeyError: \"the task has no 'start' word\""),
    (NoFirstMessages, "reset() returned no messages; it must give the first messages"),
])
def test_an_environment_that_cannot_start_ends_its_episodes_before_any_turn(engine, env, error):
    for e in [e for g in run(engine, env) for e in g.episodes]:
        assert (e.termination, e.error, e.turns, e.ids, e.reward) == ("env_error", error, 0, [], 0.0)


def test_a_slow_environment_does_not_hold_up_the_other_episodes(engine):
    order = []

    def factory(task):
        return Slow(task) if task.id == "slow" else Talk(task)

    sampling = Sampling(max_new_tokens=4, temperature=1.0, seed=1)
    from rollout.episodes import run_episodes
    t0 = time.monotonic()
    times = run_episodes(engine, engine.tokenizer, [Task("slow", "1+1=", "2"),
                                                    Task("fast", "2+2=", "4", extra={"turns": 3})],
                         2, sampling, reward_fn=REWARD, env_factory=factory, bounds=Bounds(8, 256, 30.0),
                         on_group=lambda g: order.append((g.task.id, Slow.returned.is_set())))
    wall = time.monotonic() - t0
    # The fast task's three turns were sampled while the slow one's first step was still running.
    assert order == [("fast", False), ("slow", True)]
    # Where the time went: 2 x 1 + 2 x 3 turns; 4 resets and 8 steps timed, two of them 2 s steps
    # that ran at once; engine calls and the wait for them are disjoint parts of the wall time.
    assert (times.turns, times.env_calls) == (8, 12)
    assert times.env_s >= 2 * 2.0 and times.generation_s > 0 and times.env_wait_s > 0
    assert times.generation_s + times.env_wait_s <= wall


def test_environment_steps_of_a_round_run_at_the_same_time(engine):
    # Each first step waits until all six are inside step(): run one after another, the first
    # would wait for ever (the barrier's 20 s ends it) and every episode would end env_error.
    together = threading.Barrier(6, timeout=20)

    class Together(Talk):
        def step(self, text):
            if self.n == 0:
                together.wait()
            return super().step(text)

    episodes = [e for g in run(engine, Together, turns=2) for e in g.episodes]
    assert [(e.termination, e.turns) for e in episodes] == [("done", 2)] * 6


def test_the_rank_fails_above_the_error_rate_quoting_the_first_errors_and_records_errors_below_it(engine, tmp_path):
    def run_rank(layout, rate):
        cfg = RolloutConfig(group_size=2, max_new_tokens=6, max_env_error_rate=rate)
        sampling, group = sampling_for(cfg, "train")

        def factory(task):
            return Raises(task) if task.id == "t0" else Talk(task)

        return rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="r", generation=1, policy_iteration=0),
                            Sampler(engine, engine.tokenizer, cfg, REWARD, sampling, group, factory), tasks(4))

    with pytest.raises(RolloutError, match=r"2 of 8 episodes ended with an environment error, timeout or judge "
                                           r"error, more than rollout.max_env_error_rate=0.2; first errors: task t0 episode 0 "
                                           r"\(env_error\): step\(\) raised RuntimeError: the tool is broken"):
        run_rank(RunLayout(tmp_path / "strict"), 0.2)
    layout = RunLayout(tmp_path / "lenient")
    summary = run_rank(layout, 0.25)
    assert summary.samples == 8
    rows = [r for c in sorted(layout.rollout_rank_dir("train", 1, 0).glob("*.parquet"))
            for r in store.read_rows(c)]
    failed = sorted((r["task_id"], r["termination"], r["error"]) for r in rows if r["termination"] != "done")
    assert failed == [("t0", "env_error", "step() raised RuntimeError: the tool is broken")] * 2
    assert all(len(r["loss_mask"]) == len(r["completion_ids"]) == len(r["logprobs"]) for r in rows)
    assert {r["turns"] for r in rows if r["task_id"] != "t0"} == {3}


def test_single_turn_rows_are_the_one_turn_case(engine, tmp_path):
    layout = RunLayout(tmp_path)
    cfg = RolloutConfig(group_size=2, max_new_tokens=6)
    sampling, group = sampling_for(cfg, "train")
    rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="r", generation=1, policy_iteration=0),
                 Sampler(engine, engine.tokenizer, cfg, REWARD, sampling, group), tasks(3))
    rows = [r for c in layout.rollout_rank_dir("train", 1, 0).glob("*.parquet") for r in store.read_rows(c)]
    assert len(rows) == 6
    for r in rows:
        assert r["prompt_ids"] == engine.tokenizer(r["prompt"])["input_ids"]
        assert (r["turns"], r["turn_starts"], r["termination"], r["step_rewards"]) == (1, [0], "done", [])
        assert r["reward_parts"] == [{"name": "reward", "value": r["reward"]}]
        assert r["loss_mask"] == [1] * len(r["completion_ids"]) and r["error"] is None


def test_load_env_names_the_spec_and_the_fix():
    assert load_env("tests.test_rollout_episodes:Talk") is Talk
    for spec, says in [("nope", "neither a built-in environment"), ("no_such_module:f", "cannot import module"),
                       ("tests.test_rollout_episodes:missing", "has no callable 'missing'")]:
        with pytest.raises(EnvError, match=says):
            load_env(spec)


def test_vllm_episodes_send_each_turn_as_the_ids_so_far_and_keep_the_ids_the_server_returned(tmp_path, stand_in,
                                                                                             checkpoint, engine):
    # The stand-in server answers sample j of a request with [last + j] * j + [EOS], `last` being
    # the prompt's last id: what it returns shows which ids it was sent.
    tok = engine.tokenizer
    vllm = make(tmp_path, stand_in, max_concurrency=2)
    try:
        vllm.start(checkpoint)
        groups = roll_groups(vllm, tok, tasks(3, turns=2), 3, Sampling(max_new_tokens=6, seed=1), REWARD,
                             env_factory=Talk, bounds=Bounds(8, 256, 30.0))
    finally:
        vllm.stop()
    obs = ObservationTokens(tok)([{"role": "user", "content": "again 1"}])
    eos = tok.eos_token_id
    for g in groups:
        for e in g.episodes:
            first = [e.prompt_ids[-1] + e.index] * e.index + [eos]
            assert (e.termination, e.turns) == ("done", 2)
            assert e.ids == first + obs + [eos]  # the second request was n=1 for prompt + first + obs
            assert e.loss_mask == [1] * len(first) + [0] * len(obs) + [1]
            assert e.logprobs == [-0.5] * e.index + [-1.5] + [0.0] * len(obs) + [-1.5]
    assert vllm.stats.requests == 3 + 9  # a group's first turns in one request, then one per episode
