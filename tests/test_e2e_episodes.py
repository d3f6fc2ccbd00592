"""Real runs of scripts/run.sh on guess episodes: the driver rolls out multi-turn episodes with
the environment that tasks.env names, aggregates their stats and time split, trains on their
policy tokens, and (slow tier) a worker killed mid-episodes resumes from its complete groups."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from coordination.layout import RunLayout, chunk_identity
from coordination.records import read_record
from coordination.report import make_report
from rollout import store
from rollout.tasks import Task, write_tasks
from tests.e2e import fresh_log, kill_and_restart, node_cmd, rows


def _guess_tasks(data, train: int, evals: int = 8) -> None:
    data.mkdir()
    for split, n in (("train", train), ("eval", evals)):
        write_tasks(data / f"{split}.jsonl", [Task(f"{split}-{i}", "guess", str(1 + i % 9), extra={"low": 1, "high": 9})
                                              for i in range(n)])


def _check_episode_rows(table, tasks: int, group: int) -> None:
    """Every task has its G episodes once each, and every row's token columns agree: ids, loss mask
    and logprobs of one length, a policy turn starting at each turn start, context logprobs 0."""
    pairs = list(zip(table["task_id"].to_pylist(), table["sample_index"].to_pylist()))
    assert len(pairs) == tasks * group and len(set(pairs)) == len(pairs), "an episode was lost or kept twice"
    assert sorted({i for _, i in pairs}) == list(range(group))
    for row in table.select(["completion_ids", "loss_mask", "logprobs", "turn_starts", "turns"]).to_pylist():
        ids, mask, logp, starts = row["completion_ids"], row["loss_mask"], row["logprobs"], row["turn_starts"]
        assert len(ids) == len(mask) == len(logp) and row["turns"] == len(starts) >= 1, row
        assert all(mask[s] == 1 and (s == 0 or mask[s - 1] == 0) for s in starts), row
        assert sum(mask) > 0 and all(lp == 0.0 for lp, m in zip(logp, mask) if not m), row


def test_one_node_trains_on_guess_episodes(procs, tmp_path, assets):
    _, model = assets
    data = tmp_path / "data"
    _guess_tasks(data, 48)
    log = fresh_log(tmp_path)
    procs.start("n0", node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "0",
                               overrides=("run.max_iterations=1", "tasks.env=guess", "rollout.max_turns=3",
                                          "rollout.max_new_tokens=3",
                                          "rollout.max_episode_tokens=256")))
    assert procs.wait_all(400) == {"n0": 0}, procs.log("n0")[-3000:]
    lay = RunLayout(log)
    table = rows(lay, 1)
    assert table.num_rows == 24 * 4
    turns = table["turns"].to_pylist()
    assert min(turns) >= 1 and max(turns) <= 3 and max(turns) > 1
    assert set(table["termination"].to_pylist()) <= {"done", "max_turns", "max_tokens"}
    masks, ids = table["loss_mask"].to_pylist(), table["completion_ids"].to_pylist()
    assert all(len(m) == len(i) for m, i in zip(masks, ids)) and any(0 in m for m in masks)
    stats = read_record(lay.rollout_stats("train", 1)).data
    episodes = stats["episodes"]
    assert episodes["turns_mean"] == sum(turns) / len(turns)
    assert sum(episodes["terminations"].values()) == 24 * 4
    # The time split: one reset per episode and one step per sampled turn were timed; engine calls
    # and waits for the environment are disjoint stretches of the rollout's wall time.
    assert episodes["generated_turns"] == sum(turns) and episodes["env_calls"] == 24 * 4 + sum(turns)
    assert episodes["env_seconds"] > 0 and episodes["generation_seconds"] > 0
    assert episodes["generation_seconds"] + episodes["env_wait_seconds"] <= episodes["rollout_seconds"]
    rank = stats["per_rank"]["0"]
    assert rank["turns_per_s"] == sum(turns) / rank["seconds"] and rank["samples_per_s"] == 96 / rank["seconds"]
    assert re.search(r"train rollout iter 1: 24/24 tasks, [0-9.]+ tasks/s  [0-9.]+ episodes/s  [0-9.]+ turns/s",
                     procs.log("n0")), procs.log("n0")[-3000:]
    metrics = read_record(lay.metrics(1)).data  # what the sinks and the report read
    assert {k: metrics[f"train_{k}"] for k in ("turns_mean", "env_calls", "env_seconds")} == \
        {k: episodes[k] for k in ("turns_mean", "env_calls", "env_seconds")}
    summary = Path(make_report(log)["summary"]).read_text()
    assert (f"| 1 | {episodes['success_rate']:.3f} | {episodes['turns_mean']:.2f} | "
            f"{episodes['generation_seconds']:.1f} | {episodes['env_wait_seconds']:.1f} | "
            f"{episodes['env_seconds']:.1f} |") in summary, summary
    plan = read_record(lay.training_plan(1)).data
    kept = int(pc.sum(pc.list_flatten(table["loss_mask"])).as_py())
    assert 0 < sum(s["completion_tokens"] for s in plan["steps"]) <= kept
    assert read_record(lay.latest).data["iteration"] == 1


def _episodes_of(table, task_ids) -> list[tuple]:
    picked = table.filter(pc.is_in(table["task_id"], value_set=pa.array(task_ids, pa.string())))
    cols = ("task_id", "sample_index", "completion_ids", "logprobs", "loss_mask", "reward")
    return sorted(zip(*(picked[c].to_pylist() for c in cols)))


@pytest.mark.slow
def test_worker_killed_mid_episodes_keeps_its_complete_groups_and_reruns_only_the_rest(procs, tmp_path, assets):
    """kill -9 of the worker while its episodes are in flight (its environment answers in 0.1 s,
    so a rank's rollout lasts well past its first chunk), then the same command again."""
    _, model = assets
    data = tmp_path / "data"
    _guess_tasks(data, 120)
    log = fresh_log(tmp_path)
    lay = RunLayout(log)
    over = ("run.max_iterations=1", "tasks.tasks_per_iteration=80", "tasks.env=tests.e2e_envs:SlowGuess",
            "rollout.max_turns=3", "rollout.max_new_tokens=3", "rollout.max_episode_tokens=256",
            "rollout.prompts_per_call=2", "rollout.chunk_groups=2")
    flags = ("--rl-phase", "both", "--eval-interval", "0", "--num-nodes", "2", "--rank-weights", "1,1")
    w_cmd = node_cmd(data, model, log, *flags, "--worker", "1", overrides=over)
    procs.start("n0", node_cmd(data, model, log, *flags, "--master", overrides=over))
    procs.start("n1", w_cmd)
    rank_dir, done = lay.rollout_rank_dir("train", 1, 1), lay.rollout_done("train", 1, 1)
    left: dict[str, bytes] = {}

    def keep_what_the_killed_worker_left() -> None:
        assert not done.exists(), "the worker finished its rollout before the kill: no episode was in flight"
        left.update({p.name: hashlib.sha256(p.read_bytes()).digest() for p in rank_dir.glob("chunk-*.parquet")})

    kill_and_restart(procs, "n1", w_cmd, lambda: rank_dir.exists() and any(rank_dir.glob("chunk-*.parquet")),
                     before_restart=keep_what_the_killed_worker_left)
    codes = procs.wait_all(900)
    assert codes["n0"] == 0 and codes["n1-again"] == 0, procs.log("n1-again")[-3000:] + procs.log("n0")[-3000:]
    table = rows(lay, 1)
    _check_episode_rows(table, 80, 4)
    manifest = read_record(done).data
    kept = {c["name"]: c["task_ids"] for c in manifest["chunks"] if c["name"] in left}
    rerun = [c for c in manifest["chunks"] if c["name"] not in left]
    assert kept and rerun, f"expected chunks of both processes in DONE, got {[c['name'] for c in manifest['chunks']]}"
    generation = {name: chunk_identity(name)[1] for name in [*kept, *(c["name"] for c in rerun)]}
    assert max(generation[n] for n in kept) < min(generation[c["name"]] for c in rerun), generation
    for name, task_ids in kept.items():  # immutable: the killed process's chunks, byte for byte, and their rows
        path = rank_dir / name
        assert hashlib.sha256(path.read_bytes()).digest() == left[name], f"{name} was rewritten"
        assert _episodes_of(store.read_table(path), task_ids) == _episodes_of(table, task_ids)
    kept_tasks = {t for ids in kept.values() for t in ids}
    assert kept_tasks.isdisjoint(t for c in rerun for t in c["task_ids"]), "a kept group was rolled out again"
    stats = read_record(lay.rollout_stats("train", 1)).data
    assert stats["per_rank"]["1"]["resumed_tasks"] == len(kept_tasks) > 0
    assert stats["per_rank"]["1"]["generated_samples"] == (40 - len(kept_tasks)) * 4
    assert sum(stats["episodes"]["terminations"].values()) == 80 * 4
    assert read_record(lay.latest).data["iteration"] == 1
