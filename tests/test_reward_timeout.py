"""A reward function is user code with a time limit per call (tasks.reward_timeout): a hang at the
start check is refused naming the function, a hang during a rollout ends that sample with its
reason counted, and a slow reward inside the limit keeps its value."""
from __future__ import annotations

import threading
import time

import pyarrow.compute as pc
import pytest

from coordination import metrics
from coordination.layout import RunLayout
from rollout.aggregate import aggregate
from rollout.chunks import read_chunk
from rollout.config import RolloutConfig
from rollout.rewards import TIMED_OUT, CheckedReward, RewardError, RewardTimeout, check_reward
from rollout.tasks import Task, arithmetic_tasks
from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RUN_ID = "run-test"
TASK = Task(id="t1", prompt="1+2=", answer="3")


@pytest.fixture
def release():
    """Hung calls wait on this event; setting it at teardown ends every thread a test abandoned."""
    event = threading.Event()
    yield event
    event.set()


def _hangs_when(release: threading.Event, cond):
    def reward(task, completion_text, finish_reason):
        if cond(task, completion_text, finish_reason):
            release.wait(600)
        return 1.0
    return reward


def _slow(task, completion_text, finish_reason):
    time.sleep(0.3)
    return 0.5


def test_a_hanging_reward_call_ends_after_the_timeout_naming_the_function_and_task(release):
    fn = CheckedReward("mine:hangs", _hangs_when(release, lambda *a: True), timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"reward 'mine:hangs' did not return within 0.5 s "
                                            r"\(tasks.reward_timeout\) on task 't1'"):
        fn(TASK, "3", "stop")
    assert 0.45 < time.monotonic() - t0 < 3


def test_a_slow_reward_inside_the_limit_keeps_its_value():
    fn = CheckedReward("mine:slow", _slow, timeout=5)
    assert [fn(TASK, "3", "stop") for _ in range(2)] == [0.5, 0.5]


def test_calls_after_a_timeout_run_on_a_fresh_thread_and_stuck_calls_are_bounded(release):
    fn = CheckedReward("mine:sometimes", _hangs_when(release, lambda t, text, f: text == "hang"), timeout=0.2)
    before = threading.active_count()
    for i in range(4):
        with pytest.raises(RewardTimeout):
            fn(TASK, "hang", "stop")
        if i < 3:
            assert fn(TASK, "3", "stop") == 1.0   # the next call is not queued behind the hung one
    with pytest.raises(RewardError, match=r"4 earlier calls ran past 0.2 s and are still running: the function "
                                          r"hangs") as info:
        fn(TASK, "3", "stop")
    assert not isinstance(info.value, RewardTimeout)
    assert threading.active_count() - before <= 5  # 4 stuck + 1 live worker, never one per call
    release.set()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before, "an abandoned call's thread outlived its call"


@pytest.mark.parametrize("case", ["hangs", "slow"])
def test_the_start_check_refuses_a_hanging_reward_and_accepts_a_slow_one(release, case, monkeypatch):
    import tests.e2e_rewards as mod

    fn = _hangs_when(release, lambda *a: True) if case == "hangs" else _slow
    monkeypatch.setattr(mod, "under_test", fn, raising=False)
    t0 = time.monotonic()
    if case == "slow":
        assert check_reward("tests.e2e_rewards:under_test", TASK, timeout=5)(TASK, "3", "stop") == 0.5
        return
    with pytest.raises(RewardError, match=r"reward 'tests.e2e_rewards:under_test' did not return within 0.5 s "
                                          r"\(tasks.reward_timeout\) on task 't1' at the start check"):
        check_reward("tests.e2e_rewards:under_test", TASK, timeout=0.5)
    assert time.monotonic() - t0 < 3


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def _roll(engine, layout, tasks, reward):
    cfg = RolloutConfig(group_size=3, max_new_tokens=4, chunk_groups=2, prompts_per_call=2)
    sampling, group_size = sampling_for(cfg, "train")
    target = RolloutTarget(layout, "train", 1, 0, run_id=RUN_ID, generation=1, policy_iteration=0)
    rollout_rank(target, Sampler(engine, engine.tokenizer, cfg, reward, sampling, group_size), tasks)
    return aggregate(layout, "train", 1, ranks={0: 1}, run_id=RUN_ID, expected={0: [t.id for t in tasks]},
                     group_size=group_size)


def test_a_reward_hanging_during_a_rollout_ends_those_samples_and_they_are_counted(engine, tmp_path, release, caplog):
    tasks, _ = arithmetic_tasks(4, 0, digits=2, seed=1)
    stuck = tasks[1].id
    reward = CheckedReward("mine:hangs-on-one", _hangs_when(release, lambda t, *a: t.id == stuck), timeout=0.3)
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="baton"):
        stats = _roll(engine, RunLayout(tmp_path), tasks, reward)
    assert time.monotonic() - t0 < 30
    assert stats["samples"] == 12 and stats["reward_timeouts"] == 3
    table = read_chunk(RunLayout(tmp_path).rollout_all("train", 1), run_id=RUN_ID)
    mine = table.filter(pc.equal(table["task_id"], stuck))
    assert mine["finish_reason"].to_pylist() == [TIMED_OUT] * 3 and mine["reward"].to_pylist() == [0.0] * 3
    others = table.filter(pc.not_equal(table["task_id"], stuck))
    assert TIMED_OUT not in others["finish_reason"].to_pylist() and set(others["reward"].to_pylist()) == {1.0}
    quoted = [r.getMessage() for r in caplog.records if "ends without a reward" in r.getMessage()]
    assert len(quoted) == 3 and f"reward 'mine:hangs-on-one' did not return within 0.3 s" in quoted[0]
    layout = RunLayout(tmp_path)
    record = metrics.build(layout, layout.job("both"), run_id=RUN_ID, iteration=1, num_nodes=1, policy_iteration=0,
                           train_attempt=None, eval_done=False)
    assert record["train_reward_timeouts"] == 3   # what the per-iteration metrics, plots and W&B see


def test_a_slow_reward_during_a_rollout_scores_every_sample(engine, tmp_path):
    tasks, _ = arithmetic_tasks(2, 0, digits=2, seed=1)
    stats = _roll(engine, RunLayout(tmp_path), tasks, CheckedReward("mine:slow", _slow, timeout=5))
    assert stats["reward_timeouts"] == 0 and stats["reward_mean"] == 0.5
