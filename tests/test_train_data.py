"""Phase 8: training shards and the plan from an iteration's all.parquet (written by the test)."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from coordination.config import ConfigError
from coordination.layout import RunLayout
from coordination.records import read_record
from rollout import store
from train.batches import ShardError, read_shard
from train.config import TrainConfig
from train.data import TrainingDataError, prepare_training_data, read_plan


def _row(task: str, s: int, reward: float, prompt_len: int = 4, completion_len: int = 3) -> dict:
    return {"task_id": task, "sample_index": s, "prompt": "p", "prompt_ids": [1] + [5] * (prompt_len - 1),
            "completion_ids": [6 + s] * (completion_len - 1) + [2], "logprobs": [-0.5] * completion_len,
            "text": "x", "reward": reward, "finish_reason": "stop", "policy_iteration": 0, "iteration": 1,
            "split": "train", "rank": 0, "generation": 1, **store.one_turn(completion_len)}


def _write(layout: RunLayout, rows: list[dict], iteration: int = 1) -> None:
    store.write_rows(layout.rollout_all("train", iteration), rows, run_id="run-a")


def _mixed_rows(tasks: int = 6, samples: int = 4) -> list[dict]:
    rows = []
    for t in range(tasks):
        for s in range(samples):
            reward = float(s % 2) if t % 3 else 1.0   # every third task: all correct (zero advantage)
            rows.append(_row(f"t{t}", s, reward, completion_len=2 + s))
    return rows


def _prepare(layout: RunLayout, cfg: TrainConfig, world_size: int = 2, **kw) -> Path:
    args = {"run_id": "run-a", "world_size": world_size, "temperature": 0.7,
            "input_checkpoint": Path("/models/base"), "input_iteration": 0}
    args.update(kw)
    return prepare_training_data(layout, 1, cfg, **args)


def test_plan_pins_inputs_and_each_rank_shard_holds_only_its_micro_batches(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, _mixed_rows())
    cfg = TrainConfig(steps_per_iteration=2, micro_batch_tokens=16)
    plan = read_plan(_prepare(layout, cfg))
    assert plan["input_checkpoint"] == "/models/base" and plan["input_iteration"] == 0
    assert plan["temperature"] == 0.7 and plan["world_size"] == 2 and plan["algorithm"] == "grpo"
    assert plan["stats"]["groups"] == 6 and plan["stats"]["zero_advantage_groups"] == 2
    assert plan["stats"]["samples_kept"] == 16
    assert len(plan["steps"]) == 2 and sum(s["samples"] for s in plan["steps"]) == 16
    assert [s["rank"] for s in plan["shards"]] == [0, 1]

    rows_by_rank = [read_shard(layout.training_dir(1) / s["file"], s["sha256"]) for s in plan["shards"]]
    for step_no, step in enumerate(plan["steps"]):
        step_rows = [r for shard in rows_by_rank for (st, _), rows in shard.items() if st == step_no for r in rows]
        assert len(step_rows) == step["samples"]
        assert sum(len(r["completion_ids"]) for r in step_rows) == step["completion_tokens"]
        for shard in rows_by_rank:
            assert all(m < step["micro_batches_per_rank"] for (st, m) in shard if st == step_no)
    all_rows = [r for shard in rows_by_rank for rows in shard.values() for r in rows]
    assert {r["task_id"] for r in all_rows} == {"t1", "t2", "t4", "t5"}      # t0 and t3 were all-correct
    assert sorted(round(r["advantage"], 3) for r in all_rows if r["task_id"] == "t1") == [-1.0] * 2 + [1.0] * 2


def test_prepare_is_idempotent_and_rebuilds_a_damaged_shard_identically(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, _mixed_rows())
    cfg = TrainConfig(micro_batch_tokens=32)
    path = _prepare(layout, cfg)
    first = read_record(path)
    shard = layout.training_shard(1, 1)
    original = shard.read_bytes()
    assert _prepare(layout, cfg) == path and read_record(path).wall_time == first.wall_time

    shard.write_bytes(b"garbage")
    with pytest.raises(ShardError, match="altered or is corrupt"):
        read_shard(shard, first.data["shards"][1]["sha256"])
    _prepare(layout, cfg, input_checkpoint=Path("/elsewhere"), input_iteration=5)
    assert shard.read_bytes() == original
    rebuilt = read_plan(path)
    assert rebuilt["input_checkpoint"] == "/models/base" and rebuilt["input_iteration"] == 0   # inputs stay pinned
    assert rebuilt["steps"] == first.data["steps"]


def test_a_plan_for_another_world_size_is_rebuilt_for_the_new_one(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, _mixed_rows())
    cfg = TrainConfig(micro_batch_tokens=32)
    _prepare(layout, cfg, world_size=2)
    plan = read_plan(_prepare(layout, cfg, world_size=3))
    assert plan["world_size"] == 3 and len(plan["shards"]) == 3


def test_all_zero_advantage_groups_give_a_plan_without_steps(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, [_row(f"t{t}", s, 1.0) for t in range(3) for s in range(4)])
    plan = read_plan(_prepare(layout, TrainConfig()))
    assert plan["steps"] == [] and plan["shards"] == []
    assert "zero advantage" in plan["zero_steps_reason"]


def test_rejection_sampling_keeps_only_successful_samples_with_unit_weight(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, _mixed_rows())
    plan = read_plan(_prepare(layout, TrainConfig(algorithm="rft", micro_batch_tokens=64), world_size=1))
    rows = pq.read_table(layout.training_shard(1, 0)).to_pylist()
    assert len(rows) == plan["stats"]["samples_kept"] == 2 * 4 + 4 * 2
    assert {r["advantage"] for r in rows} == {1.0}


def test_packing_respects_the_token_budget_in_the_shards(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, _mixed_rows(tasks=9, samples=4))
    plan = read_plan(_prepare(layout, TrainConfig(steps_per_iteration=1, micro_batch_tokens=20)))
    for s in plan["shards"]:
        for rows in read_shard(layout.training_dir(1) / s["file"], s["sha256"]).values():
            width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
            assert len(rows) * width <= 20


def test_missing_trajectories_and_kl_without_reference_are_explained(tmp_path):
    layout = RunLayout(tmp_path)
    with pytest.raises(TrainingDataError, match="does not exist.*phase 3"):
        _prepare(layout, TrainConfig())
    _write(layout, _mixed_rows())
    with pytest.raises(TrainingDataError, match="reference model"):
        _prepare(layout, TrainConfig(kl_coef=0.1))


def test_several_epochs_reshuffle_and_use_every_sample_once_per_epoch(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, _mixed_rows())
    plan = read_plan(_prepare(layout, TrainConfig(steps_per_iteration=4, epochs=2, micro_batch_tokens=64),
                              world_size=1))
    shard = read_shard(layout.training_shard(1, 0), plan["shards"][0]["sha256"])
    per_step = [sorted((r["task_id"], r["sample_index"]) for (st, _), rows in shard.items() if st == s for r in rows)
                for s in range(4)]
    assert [len(p) for p in per_step] == [8, 8, 8, 8]
    assert sorted(per_step[0] + per_step[1]) == sorted(per_step[2] + per_step[3])   # each pass covers all 16
    assert len(set(per_step[0] + per_step[1])) == 16
    assert per_step[0] != per_step[2]                                                # reshuffled


def test_a_group_with_a_timed_out_reward_is_not_trained_on(tmp_path):
    """A sample whose reward ran past tasks.reward_timeout carries reward 0, which is no score:
    its whole group is left out, where its 0 would otherwise give the others advantages."""
    from rollout.rewards import TIMED_OUT

    layout = RunLayout(tmp_path)
    rows = _mixed_rows()
    for r in rows:
        if r["task_id"] == "t1" and r["sample_index"] == 1:
            r.update(reward=0.0, finish_reason=TIMED_OUT)
    _write(layout, rows)
    plan = read_plan(_prepare(layout, TrainConfig(micro_batch_tokens=32)))
    assert plan["stats"]["reward_timeout_groups"] == 1 and plan["stats"]["samples_kept"] == 12
    kept = {r["task_id"] for s in plan["shards"]
            for rows_ in read_shard(layout.training_dir(1) / s["file"], s["sha256"]).values() for r in rows_}
    assert kept == {"t2", "t4", "t5"}


def test_with_cp_the_ranks_of_a_group_get_the_same_rows_packed_for_world_over_cp_data_ranks(tmp_path):
    layout = RunLayout(tmp_path)
    _write(layout, _mixed_rows())
    cfg = TrainConfig(steps_per_iteration=2, micro_batch_tokens=16, cp=2)
    plan = read_plan(_prepare(layout, cfg, world_size=4))
    shards = [read_shard(layout.training_dir(1) / s["file"], s["sha256"]) for s in plan["shards"]]
    assert len(shards) == 4
    assert shards[0] == shards[1] and shards[2] == shards[3] and shards[0] != shards[2]
    # Each sample once over the two data ranks (ranks 0 and 2), as a 2-rank plan without cp packs it.
    for step_no, step in enumerate(plan["steps"]):
        rows = [r for shard in (shards[0], shards[2]) for (st, _), rs in shard.items() if st == step_no for r in rs]
        assert len(rows) == step["samples"]
    flat_layout = RunLayout(tmp_path / "flat")
    _write(flat_layout, _mixed_rows())
    flat = read_plan(_prepare(flat_layout, TrainConfig(steps_per_iteration=2, micro_batch_tokens=16), world_size=2))
    assert [s["micro_batches_per_rank"] for s in flat["steps"]] == [s["micro_batches_per_rank"] for s in plan["steps"]]
    with pytest.raises(ConfigError, match="train.cp=2 does not divide the number of trainer processes \\(3"):
        _prepare(RunLayout(tmp_path / "odd"), cfg, world_size=3)
