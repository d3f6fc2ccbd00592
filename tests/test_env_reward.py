"""The episode reward's parts: the environment's step rewards summed, last or ignored
(tasks.env_reward), tasks.reward on the whole episode (with the episode's messages), each part
named in the episode and its row."""
from __future__ import annotations

import pytest

from coordination.config import ConfigError, load
from coordination.layout import RunLayout
from rollout import store
from rollout.config import RolloutConfig, TasksConfig
from rollout.engine import Sampling
from rollout.envs import Step
from rollout.episodes import Bounds
from rollout.rewards import load_reward
from rollout.scoring import Scoring, env_part
from rollout.tasks import Task
from rollout.worker import RolloutTarget, Sampler, roll_groups, rollout_rank, sampling_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEEN: list[tuple[str, str, list]] = []  # (completion_text, finish_reason, messages) of each call


def whole_episode(task, completion_text, finish_reason, messages):
    """A reward that sees the episode: 0.5 per message of it."""
    SEEN.append((completion_text, finish_reason, [dict(m) for m in messages]))
    return 0.5 * len(messages)


class Rewards:
    """Three turns; its steps give 0.25, no reward, then 2.0."""

    def __init__(self, task):
        self.task, self.n = task, 0

    def reset(self):
        return [{"role": "system", "content": "play"}, {"role": "user", "content": self.task["prompt"]}]

    def step(self, text):
        self.n += 1
        reward = {1: 0.25, 2: None, 3: 2.0}[self.n]
        return Step([{"role": "user", "content": f"turn {self.n}"}], reward, self.n == 3)


def episodes(engine, scoring, reward="arithmetic"):
    task = Task(id="t", prompt="1+1=", answer="2")
    groups = roll_groups(engine, engine.tokenizer, [task], 2, Sampling(max_new_tokens=4, seed=1), load_reward(reward),
                         env_factory=Rewards, bounds=Bounds(8, 512, 30.0), scoring=scoring)
    return groups[0].episodes


@pytest.mark.parametrize("mode, part", [("sum", 2.25), ("last", 2.0)])
def test_env_reward_sums_or_keeps_the_last_step_reward(tiny_engine, mode, part):
    for e in episodes(tiny_engine, Scoring(mode)):
        assert (e.termination, e.turns, e.step_rewards) == ("done", 3, [0.25, 2.0])
        assert e.reward_parts == {"env": part} and e.reward == part


def test_env_reward_none_with_the_reward_on_the_whole_episode_scores_the_messages(tiny_engine):
    SEEN.clear()
    eps = episodes(tiny_engine, Scoring("none", reward_with_env=True), "tests.test_env_reward:whole_episode")
    assert len(SEEN) == 2
    for e, (text, finish, messages) in zip(eps, SEEN):
        # reset's two messages, then three turns each answered by one observation but the last
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        assert messages[:2] == [{"role": "system", "content": "play"}, {"role": "user", "content": "1+1="}]
        assert [m["content"] for m in messages[3::2]] == ["turn 1", "turn 2"] and len(messages) == 7
        assert turns == e.pieces[0::2] and text == turns[-1] and finish == e.finish_reason
        assert e.reward_parts == {"reward": 3.5} and e.reward == 3.5


def test_env_and_reward_parts_add_up_and_land_in_the_rows(tiny_engine, tmp_path):
    layout = RunLayout(tmp_path)
    cfg = RolloutConfig(group_size=2, max_new_tokens=4)
    sampling, group = sampling_for(cfg, "train")
    tasks = [Task(id=f"t{i}", prompt=f"{i}+1=", answer=str(i + 1)) for i in range(2)]
    rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="r", generation=1, policy_iteration=0),
                 Sampler(tiny_engine, tiny_engine.tokenizer, cfg, load_reward("tests.test_env_reward:whole_episode"),
                         sampling, group, Rewards, Scoring("last", reward_with_env=True)), tasks)
    rows = [r for c in layout.rollout_rank_dir("train", 1, 0).glob("*.parquet") for r in store.read_rows(c)]
    assert len(rows) == 4
    for r in rows:
        assert r["step_rewards"] == [0.25, 2.0]
        assert r["reward_parts"] == [{"name": "env", "value": 2.0}, {"name": "reward", "value": 3.5}]
        assert r["reward"] == 5.5


def test_env_part_of_steps_that_gave_no_reward():
    assert (env_part([], "sum"), env_part([], "last"), env_part([1.0], "none")) == (0.0, 0.0, None)


def test_a_bad_env_reward_names_the_value_and_the_choices():
    with pytest.raises(ConfigError, match=r"env_reward='max' is not one of sum, last, none"):
        load(TasksConfig, [], ["env_reward=max"])
