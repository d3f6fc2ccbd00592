"""Aggregation of rank chunks into all.parquet and stats.json, and eval metrics."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from coordination.layout import RunLayout
from coordination.records import read_record
from rollout import store
from rollout.aggregate import AggregationError, aggregate
from rollout.chunks import Manifest, list_chunks, publish_done, write_chunk
from rollout.config import RolloutConfig
from rollout.engines.transformers_engine import TransformersEngine
from rollout.eval import evaluate, pass_at_k
from rollout.rewards import load_reward
from rollout.split import split_plan
from rollout.tasks import arithmetic_tasks
from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for
from train.tiny import write_tiny_model

RUN_ID = "run-agg"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rows_for(task_id: str, rewards: list[float], *, rank: int, generation: int = 1, split: str = "train",
             lengths: list[int] | None = None) -> list[dict]:
    lengths = lengths or [3] * len(rewards)
    return [{"task_id": task_id, "sample_index": j, "prompt": "1+1=", "prompt_ids": [1, 20, 15, 20, 33],
             "completion_ids": [20] * n, "logprobs": [-0.5] * n, "text": "2", "reward": r,
             "finish_reason": "stop" if n < 4 else "length", "policy_iteration": 0, "iteration": 1,
             "split": split, "rank": rank, "generation": generation, **store.one_turn(n)}
            for j, (r, n) in enumerate(zip(rewards, lengths))]


def write_rank(layout: RunLayout, rank: int, groups: dict[str, list[float]], *, generation: int = 1,
               split: str = "train", group_size: int = 2, seconds: float = 2.0, per_chunk: int = 2,
               **times: float) -> list[str]:
    """Chunks of `groups` (task id -> rewards) and a DONE listing them (with the episode `times`,
    Manifest's fields); returns the task ids."""
    manifest = Manifest(split, 1, rank, group_size, 0, seconds=seconds, **times)
    ids = list(groups)
    for seq, start in enumerate(range(0, len(ids), per_chunk)):
        part = ids[start:start + per_chunk]
        path = layout.rollout_chunk(split, 1, rank, seq, generation)
        write_chunk(path, [r for t in part for r in rows_for(t, groups[t], rank=rank, generation=generation,
                                                                split=split)], run_id=RUN_ID, generation=generation)
        manifest.chunks.append({"name": path.name, "task_ids": part})
    manifest.samples = len(ids) * group_size
    manifest.completion_tokens = manifest.generated_tokens = 3 * manifest.samples
    manifest.generated_samples = manifest.samples
    publish_done(layout.rollout_done(split, 1, rank), manifest, run_id=RUN_ID, generation=generation)
    return ids


def pairs(table: pa.Table) -> list[tuple[str, int]]:
    return list(zip(table["task_id"].to_pylist(), table["sample_index"].to_pylist()))


def test_stats_of_known_rewards(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 1.0], "b": [0.0, 1.0]}, seconds=2.0)
    write_rank(layout, 1, {"c": [0.0, 0.0], "d": [1.0, 1.0]}, seconds=4.0)
    stats = aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2)
    rewards = np.array([1, 1, 0, 1, 0, 0, 1, 1], dtype=float)
    assert (stats["tasks"], stats["samples"]) == (4, 8)
    assert math.isclose(stats["reward_mean"], rewards.mean()) and math.isclose(stats["reward_std"], rewards.std())
    assert math.isclose(stats["pass_at_1"], 5 / 8) and math.isclose(stats["pass_at_2"], 3 / 4)
    assert (stats["groups_all_solved"], stats["groups_none_solved"]) == (0.5, 0.25)
    assert stats["completion_tokens"]["mean"] == 3.0 and stats["truncated"] == 0.0
    assert stats["per_rank"]["1"]["tokens_per_s"] == 12 / 4.0 and stats["tokens_per_s"] == 24 / 4.0 and stats["wall_seconds"] == 4.0
    record = read_record(layout.rollout_stats("train", 1), kind="rollout-stats", run_id=RUN_ID)
    assert record.data["pass_at_1"] == stats["pass_at_1"]


def test_aggregation_of_real_rank_rollouts_equals_their_union(tmp_path_factory, tmp_path):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    layout = RunLayout(tmp_path)
    tasks, _ = arithmetic_tasks(11, 0, digits=2, seed=9)
    cfg = RolloutConfig(group_size=3, max_new_tokens=6, chunk_groups=2, prompts_per_call=2)
    sampling, group_size = sampling_for(cfg, "train")
    plan = split_plan(tasks, [1.0, 2.0, 1.0])
    union = []
    with TransformersEngine() as engine:
        engine.start(model)
        for rank, share in enumerate(plan):
            rollout_rank(RolloutTarget(layout, "train", 1, rank, run_id=RUN_ID, generation=1, policy_iteration=0),
                         Sampler(engine, engine.tokenizer, cfg, load_reward("arithmetic"), sampling, group_size), share)
            for chunk in list_chunks(layout.rollout_rank_dir("train", 1, rank)):
                union.extend(store.read_table(chunk.path).to_pylist())
    stats = aggregate(layout, "train", 1, ranks={0: 1, 1: 1, 2: 1}, run_id=RUN_ID, group_size=3,
                      expected={r: [t.id for t in share] for r, share in enumerate(plan)})
    merged = store.read_table(layout.rollout_all("train", 1)).to_pylist()
    key = lambda row: (row["task_id"], row["sample_index"])  # noqa: E731
    assert sorted(merged, key=key) == sorted(union, key=key)
    assert len(merged) == 33 and stats["samples"] == 33 and stats["tasks"] == 11
    assert {r: v["tasks"] for r, v in stats["per_rank"].items()} == {"0": 3, "1": 5, "2": 3}


def test_stale_generation_chunk_is_ignored(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0], "b": [1.0, 1.0]}, generation=2)
    # A fenced generation-1 process wrote this after its successor: duplicate and foreign rows.
    stale = layout.rollout_chunk("train", 1, 0, 9, 1)
    write_chunk(stale, rows_for("a", [0.0, 0.0], rank=0) + rows_for("zz", [1.0, 1.0], rank=0),
                run_id=RUN_ID, generation=1)
    stats = aggregate(layout, "train", 1, ranks={0: 2}, run_id=RUN_ID, group_size=2)
    merged = store.read_table(layout.rollout_all("train", 1))
    assert sorted(pairs(merged)) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert merged["reward"].to_pylist() == [1.0, 0.0, 1.0, 1.0] and stats["samples"] == 4
    assert set(merged["generation"].to_pylist()) == {2}


def test_done_newer_than_the_arrival_or_missing_is_an_error_naming_rank_and_file(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0]}, generation=2)
    write_rank(layout, 1, {"b": [1.0, 0.0]}, generation=3)
    done1 = layout.rollout_done("train", 1, 1)
    with pytest.raises(AggregationError, match=rf"rank 1: {done1} was written by generation 3, newer than the "
                                               rf"generation 2"):
        aggregate(layout, "train", 1, ranks={0: 2, 1: 2}, run_id=RUN_ID, group_size=2)
    done2 = layout.rollout_done("train", 1, 2)
    with pytest.raises(AggregationError, match=rf"rank 2: {done2} is missing.*has not finished"):
        aggregate(layout, "train", 1, ranks={0: 2, 1: 3, 2: 1}, run_id=RUN_ID, group_size=2)
    assert not layout.rollout_all("train", 1).exists() and not layout.rollout_stats("train", 1).exists()


def test_done_of_a_predecessor_generation_is_adopted(tmp_path):
    # Rank 1 finished as generation 1, died, and generation 2 adopted its arrival without redoing it.
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0]}, generation=2)
    write_rank(layout, 1, {"b": [1.0, 0.0]}, generation=1)
    stats = aggregate(layout, "train", 1, ranks={0: 2, 1: 2}, run_id=RUN_ID, group_size=2)
    assert stats["samples"] == 4


def test_unreadable_or_short_rank_file_is_an_error_naming_rank_and_file(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0], "b": [0.0, 0.0]})
    write_rank(layout, 1, {"c": [1.0, 0.0]})
    chunk = layout.rollout_chunk("train", 1, 1, 0, 1)
    chunk.write_bytes(b"garbage")
    with pytest.raises(AggregationError, match=rf"rank 1: trajectory file {chunk} is unreadable"):
        aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2)
    chunk.unlink()
    with pytest.raises(AggregationError, match=rf"rank 1: trajectory file {chunk} does not exist"):
        aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2)
    write_chunk(chunk, rows_for("c", [1.0], rank=1), run_id=RUN_ID, generation=1)   # one sample of two
    with pytest.raises(AggregationError, match=rf"rank 1: {chunk}: 1 rows for 1 listed tasks x 2 samples"):
        aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2)


def test_expected_tasks_must_each_be_present_exactly_once(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0], "b": [0.0, 0.0]})
    write_rank(layout, 1, {"b": [1.0, 1.0]})
    with pytest.raises(AggregationError, match=r"rank 0: .*DONE does not match the rank's share: 1 tasks missing "
                                               r"\['x'\], 1 unexpected \['b'\]"):
        aggregate(layout, "train", 1, ranks={0: 1}, run_id=RUN_ID, group_size=2, expected={0: ["a", "x"]})
    with pytest.raises(AggregationError, match=r"task .b. was rolled out by ranks \[0, 1\] in train iteration 1"):
        aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2)


def test_aggregation_is_idempotent_and_redone_when_inputs_change(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0]})
    first = aggregate(layout, "train", 1, ranks={0: 1}, run_id=RUN_ID, group_size=2)
    inode = layout.rollout_all("train", 1).stat().st_ino
    again = aggregate(layout, "train", 1, ranks={0: 1}, run_id=RUN_ID, group_size=2)
    assert again == json.loads(json.dumps(first))
    assert layout.rollout_all("train", 1).stat().st_ino == inode          # not rewritten
    write_rank(layout, 0, {"a": [1.0, 1.0], "b": [1.0, 1.0]}, generation=2)  # the rank was redone
    redone = aggregate(layout, "train", 1, ranks={0: 2}, run_id=RUN_ID, group_size=2)
    assert redone["samples"] == 4 and redone["reward_mean"] == 1.0


def test_eval_stats_carry_accuracy_metrics(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0], "b": [0.0], "c": [1.0]}, split="eval", group_size=1)
    stats = aggregate(layout, "eval", 1, ranks={0: 1}, run_id=RUN_ID, group_size=1)
    ev = stats["eval"]
    assert (ev["count"], ev["samples"], ev["mean_completion_tokens"]) == (3, 3, 3.0)
    assert math.isclose(ev["accuracy"], 2 / 3) and math.isclose(ev["pass_at_k"]["1"], 2 / 3)
    layout2 = RunLayout(tmp_path / "g4")
    write_rank(layout2, 0, {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.0] * 4}, split="eval", group_size=4)
    ev4 = aggregate(layout2, "eval", 1, ranks={0: 1}, run_id=RUN_ID, group_size=4)["eval"]
    assert math.isclose(ev4["accuracy"], 1 / 8)                                  # pass@1 with 4 samples
    assert math.isclose(ev4["pass_at_k"]["2"], (1 - 3 / 6) / 2) and math.isclose(ev4["pass_at_k"]["4"], 0.5)


def test_pass_at_k_matches_the_combinatorial_definition():
    from math import comb
    n = np.array([8, 8, 8, 5, 5])
    c = np.array([0, 3, 8, 1, 4])
    for k in (1, 2, 4, 5):
        exact = np.mean([1 - comb(ni - ci, k) / comb(ni, k) for ni, ci in zip(n, c)])
        assert math.isclose(pass_at_k(n, c, k), exact, rel_tol=1e-12)
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples"):
        pass_at_k(n, c, 8)


def test_in_memory_evaluate_matches_the_greedy_rollout(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    _, evals = arithmetic_tasks(0, 8, digits=1, seed=1)
    with TransformersEngine() as engine:
        engine.start(model)
        metrics = evaluate(engine, engine.tokenizer, evals, lambda t, text, fr: float(len(text) % 2),
                           sampling=sampling_for(RolloutConfig(max_new_tokens=5), "eval")[0], prompts_per_call=3)
        texts = [g[0].text for g in engine.generate([engine.tokenizer(t.prompt)["input_ids"] for t in evals], 1,
                                                    sampling_for(RolloutConfig(max_new_tokens=5), "eval")[0])]
    assert metrics["count"] == 8 and math.isclose(metrics["accuracy"], np.mean([len(t) % 2 for t in texts]))


def test_nothing_written_to_the_run_directory_is_pickled(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0]})
    write_rank(layout, 0, {"e": [1.0]}, split="eval", group_size=1)
    aggregate(layout, "train", 1, ranks={0: 1}, run_id=RUN_ID, group_size=2)
    aggregate(layout, "eval", 1, ranks={0: 1}, run_id=RUN_ID, group_size=1)
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    assert len(files) == 8
    for p in files:
        data = p.read_bytes()
        assert not data.startswith(b"\x80"), f"{p} looks like a pickle"
        if p.suffix == ".parquet":
            assert data[:4] == data[-4:] == b"PAR1"
        else:
            assert json.loads(data)["format"] == "baton/1"


def test_rank_with_zero_weight_contributes_an_empty_done(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0]})
    write_rank(layout, 1, {})
    stats = aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2, expected={0: ["a"], 1: []})
    assert stats["samples"] == 2 and stats["per_rank"]["1"]["tasks"] == 0
    assert store.read_table(layout.rollout_all("train", 1)).num_rows == 2


def test_group_with_repeated_sample_index_is_an_error_naming_rank_and_done(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0]})
    write_rank(layout, 1, {"b": [1.0, 0.0]})
    rows = rows_for("b", [1.0, 0.0], rank=1)
    rows[1]["sample_index"] = 0
    write_chunk(layout.rollout_chunk("train", 1, 1, 0, 1), rows, run_id=RUN_ID, generation=1)
    done = layout.rollout_done("train", 1, 1)
    with pytest.raises(AggregationError, match=rf"rank 1: {done} lists task 'b' with sample indices \[0, 0\], "
                                               rf"expected 0..1 once each"):
        aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2)


def test_episode_stats_count_success_turns_terminations_and_the_time_split_of_every_rank(tmp_path):
    layout = RunLayout(tmp_path)
    write_rank(layout, 0, {"a": [1.0, 0.0], "b": [0.0, 1.0]}, seconds=4.0, generated_turns=11,
               generation_seconds=1.5, env_wait_seconds=2.0, env_seconds=6.25, env_calls=15)
    write_rank(layout, 1, {"c": [0.0, 0.0]}, seconds=2.0, generated_turns=3, generation_seconds=0.5,
               env_wait_seconds=1.25, env_seconds=2.0, env_calls=5)
    chunk = layout.rollout_chunk("train", 1, 0, 0, 1)
    table = store.read_table(chunk)
    rows = table.to_pylist()
    for row, (turns, termination) in zip(rows, [(3, "done"), (5, "max_turns"), (1, "env_error"), (2, "done")]):
        row.update(turns=turns, termination=termination)
    chunk.unlink()
    write_chunk(chunk, rows, run_id=RUN_ID, generation=1)
    stats = aggregate(layout, "train", 1, ranks={0: 1, 1: 1}, run_id=RUN_ID, group_size=2)
    # Rank 1's two one-turn episodes scored 0: 2 successes and 13 turns in 6 episodes.
    assert stats["episodes"] == {"success_rate": 2 / 6, "turns_mean": 13 / 6, "turns_max": 5,
                                 "terminations": {"done": 4, "env_error": 1, "max_turns": 1},
                                 "generation_seconds": 2.0, "env_wait_seconds": 3.25, "env_seconds": 8.25,
                                 "env_calls": 20, "generated_turns": 14, "rollout_seconds": 6.0}
    assert (stats["per_rank"]["0"]["turns_per_s"], stats["per_rank"]["1"]["turns_per_s"]) == (11 / 4, 3 / 2)
    assert stats["per_rank"]["1"]["env_wait_seconds"] == 1.25
