"""The `tasks` and `rollout` config sections: defaults, documentation, checks."""
from __future__ import annotations

import dataclasses

import pytest

from coordination.config import ConfigError, field_help, from_dict
from rollout.config import RolloutConfig, TasksConfig


def test_defaults_match_the_driver_contract():
    t, r = TasksConfig(), RolloutConfig()
    assert (t.train_file, t.eval_file, t.tasks_per_iteration, t.eval_tasks, t.reward) == \
        ("train.jsonl", "eval.jsonl", 64, 0, "arithmetic")
    assert (r.group_size, r.max_new_tokens, r.temperature, r.top_p, r.seed, r.eval_group_size,
            r.eval_temperature, r.chunk_groups, r.chunk_seconds) == (8, 8, 1.0, 1.0, 0, 1, 0.0, 8, 30.0)


@pytest.mark.parametrize("cls", [TasksConfig, RolloutConfig])
def test_every_field_has_help_text(cls):
    helps = field_help(cls)   # a nested section's keys come dotted (tasks.judge.model), each with its own help
    assert {k.split(".")[0] for k in helps} == {f.name for f in dataclasses.fields(cls)}
    assert [k for k, h in helps.items() if len(h) <= 10] == []


@pytest.mark.parametrize("cls, data, message", [
    (RolloutConfig, {"group_size": 0}, "group_size must be positive (got 0)"),
    (RolloutConfig, {"top_p": 1.5}, "top_p must be in (0, 1] (got 1.5)"),
    (RolloutConfig, {"temperature": -1}, "temperature must be zero or positive"),
    (RolloutConfig, {"eval_group_size": 4}, "eval_group_size=4 with eval_temperature=0"),
    (RolloutConfig, {"chunk_seconds": 0}, "chunk_seconds must be positive"),
    (TasksConfig, {"tasks_per_iteration": 0}, "tasks_per_iteration must be positive"),
    (TasksConfig, {"eval_tasks": -1}, "eval_tasks must be zero or positive"),
    (TasksConfig, {"reward": "exact"}, "reward='exact' is neither"),
    (TasksConfig, {"train_file": " "}, "train_file must name a JSONL file"),
])
def test_bad_values_are_refused_naming_key_and_value(cls, data, message):
    with pytest.raises(ConfigError) as err:
        from_dict(cls, data)
    assert message in str(err.value)


def test_valid_overrides_load():
    cfg = from_dict(RolloutConfig, {"eval_group_size": 4, "eval_temperature": 0.6, "prompts_per_call": 2})
    assert (cfg.eval_group_size, cfg.eval_temperature, cfg.prompts_per_call) == (4, 0.6, 2)
    assert from_dict(TasksConfig, {"reward": "my_pkg.rewards:score"}).reward == "my_pkg.rewards:score"
