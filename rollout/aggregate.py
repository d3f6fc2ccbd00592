"""The master merges every rank's chunks into all.parquet and stats.json (docs/design.md §6 phases 3, 6).

Only current work counts: each rank's DONE must be of the rank's current generation (a stale
DONE means the rank has not finished since its restart), and only the (chunk, task) pairs DONE
lists are taken, so rows of a fenced process or of a group cut short are never merged. Every
problem is an error naming the rank and the file; nothing is skipped silently. The merge is
columnar (pyarrow filters and concatenation), never a Python loop over rows.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from coordination import log
from coordination.layout import RunLayout
from coordination.records import NotThereYet, WrongRun, publish_record, read_or_none
from rollout import store
from rollout.chunks import Manifest, RolloutError, chunk_path, parquet_rows, read_chunk, read_done
from rollout.eval import eval_metrics, pass_at_k
from rollout.rewards import TIMED_OUT

STATS_KIND = "rollout-stats"
_log = log.get("aggregate")


class AggregationError(RolloutError):
    """A rank's rollout output is missing, stale or inconsistent; the message names rank and file."""


def _expected_digest(expected: Mapping[int, Sequence[str]] | None) -> str | None:
    if expected is None:
        return None
    h = hashlib.sha256()
    for rank in sorted(expected):
        h.update(f"{rank}:".encode() + "\0".join(sorted(expected[rank])).encode() + b"\n")
    return h.hexdigest()[:16]


def _rank_table(layout: RunLayout, split: str, iteration: int, rank: int, generation: int, run_id: str,
                expected: Sequence[str] | None, group_size: int) -> tuple[pa.Table, Manifest]:
    done_path = layout.rollout_done(split, iteration, rank)
    try:
        manifest, done_gen = read_done(done_path, run_id=run_id)
    except NotThereYet as exc:
        raise AggregationError(f"rank {rank}: {done_path} is missing or unreadable ({exc}); the rank has not "
                               f"finished its {split} rollout") from None
    except WrongRun as exc:
        raise AggregationError(f"rank {rank}: {exc}") from None
    # A DONE of an older generation is the finished work of a predecessor that the restarted rank
    # adopted (its arrival was re-stamped, its chunks are immutable). One of a newer generation
    # means the caller's view of the rank is out of date.
    if done_gen > generation:
        raise AggregationError(f"rank {rank}: {done_path} was written by generation {done_gen}, newer than the "
                               f"generation {generation} that arrived at the barrier; aggregate again with the "
                               f"rank's current arrival")
    if manifest.group_size != group_size:
        raise AggregationError(f"rank {rank}: {done_path} has groups of {manifest.group_size} samples, expected "
                               f"{group_size}; was the rank run with another rollout config?")
    listed = manifest.task_ids
    if len(set(listed)) != len(listed):
        dup = next(t for t in listed if listed.count(t) > 1)
        raise AggregationError(f"rank {rank}: {done_path} lists task {dup!r} in more than one chunk")
    if expected is not None and set(listed) != set(expected):
        missing = sorted(set(expected) - set(listed))
        extra = sorted(set(listed) - set(expected))
        raise AggregationError(f"rank {rank}: {done_path} does not match the rank's share: "
                               f"{len(missing)} tasks missing {missing[:5]}, {len(extra)} unexpected {extra[:5]}")
    rank_dir = layout.rollout_rank_dir(split, iteration, rank)
    parts = []
    for entry in manifest.chunks:
        path = chunk_path(rank_dir, entry["name"])
        try:
            table = read_chunk(path, run_id=run_id)
        except store.TrajectoryFileError as exc:
            raise AggregationError(f"rank {rank}: {exc}") from None
        table = table.filter(pc.is_in(table["task_id"], value_set=pa.array(entry["task_ids"], pa.string())))
        n, bad = table.num_rows, None
        if n != len(entry["task_ids"]) * group_size:
            bad = f"{n} rows for {len(entry['task_ids'])} listed tasks x {group_size} samples"
        elif n and not (pc.all(pc.equal(table["rank"], rank)).as_py()
                        and pc.all(pc.equal(table["iteration"], iteration)).as_py()):
            bad = "rows of another rank or iteration"
        if bad:
            raise AggregationError(f"rank {rank}: {path}: {bad}; remove {done_path} so the rank rolls out again")
        parts.append(table.replace_schema_metadata(None))
    table = pa.concat_tables(parts) if parts else store.SCHEMA.empty_table()
    return table, manifest


def _group_counts(merged: pa.Table, layout: RunLayout, split: str, iteration: int, group_size: int,
                  success_reward: float) -> tuple[np.ndarray, np.ndarray]:
    """(samples, solved samples) per task, after checking that every task holds exactly the
    sample indices 0..G-1 once. One group-by over all ranks serves both the check and the stats."""
    if merged.num_rows == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    solved = pc.cast(pc.greater_equal(merged["reward"], pa.scalar(success_reward, pa.float32())), pa.int64())
    g = pa.table({"task_id": merged["task_id"], "sample_index": merged["sample_index"], "solved": solved}) \
        .group_by("task_id").aggregate([("sample_index", "count"), ("sample_index", "count_distinct"),
                                        ("sample_index", "min"), ("sample_index", "max"), ("solved", "sum")])
    ok = pc.and_(pc.and_(pc.equal(g["sample_index_count"], group_size),
                         pc.equal(g["sample_index_count_distinct"], group_size)),
                 pc.and_(pc.equal(g["sample_index_min"], 0), pc.equal(g["sample_index_max"], group_size - 1)))
    if not pc.all(ok).as_py():
        task = g.filter(pc.invert(ok))["task_id"][0].as_py()
        rows = merged.filter(pc.equal(merged["task_id"], task))
        owners = sorted(set(rows["rank"].to_pylist()))
        if len(owners) > 1:
            raise AggregationError(
                f"task {task!r} was rolled out by ranks {owners} in {split} iteration {iteration} (see their DONE "
                f"files, e.g. {layout.rollout_done(split, iteration, owners[1])}); every rank must use the same "
                f"rank weights")
        raise AggregationError(
            f"rank {owners[0]}: {layout.rollout_done(split, iteration, owners[0])} lists task {task!r} with sample "
            f"indices {sorted(rows['sample_index'].to_pylist())}, expected 0..{group_size - 1} once each; remove "
            f"that DONE so the rank rolls out again")
    return g["sample_index_count"].to_numpy(), g["solved_sum"].to_numpy()


def _length_stats(lengths: np.ndarray) -> dict[str, float]:
    if lengths.size == 0:
        return {k: 0.0 for k in ("mean", "std", "min", "p50", "p90", "max")}
    p50, p90 = np.percentile(lengths, [50, 90])
    return {"mean": float(lengths.mean()), "std": float(lengths.std()), "min": float(lengths.min()),
            "p50": float(p50), "p90": float(p90), "max": float(lengths.max())}


def _episode_stats(table: pa.Table, success_reward: float) -> dict[str, Any]:
    """Success rate, turns per episode and how episodes ended (`termination`, rollout/episodes.py)."""
    if table.num_rows == 0:
        return {"success_rate": 0.0, "turns_mean": 0.0, "turns_max": 0, "terminations": {}}
    turns = table["turns"].to_numpy().astype(np.float64)
    ended = pc.value_counts(table["termination"]).to_pylist()
    return {"success_rate": float(pc.mean(pc.cast(pc.greater_equal(table["reward"], success_reward),
                                                     pa.float64())).as_py()),
            "turns_mean": float(turns.mean()), "turns_max": int(turns.max()),
            "terminations": {d["values"]: int(d["counts"]) for d in sorted(ended, key=lambda d: d["values"])}}


def _time_split(manifests: Iterable[Manifest]) -> dict[str, float]:
    """Rank-seconds of this iteration's rollout by what they waited for, summed over ranks (only
    what the current processes generated: resumed groups were timed by their killed writer)."""
    ms = list(manifests)
    return {"generation_seconds": sum(m.generation_seconds for m in ms),
            "env_wait_seconds": sum(m.env_wait_seconds for m in ms),
            "env_seconds": sum(m.env_seconds for m in ms), "env_calls": sum(m.env_calls for m in ms),
            "generated_turns": sum(m.generated_turns for m in ms),
            "rollout_seconds": sum(m.seconds for m in ms)}


def compute_stats(table: pa.Table, counts: tuple[np.ndarray, np.ndarray], manifests: Mapping[int, Manifest],
                  generations: Mapping[int, int], *, split: str, iteration: int, group_size: int,
                  success_reward: float) -> dict[str, Any]:
    rewards = table["reward"].to_numpy().astype(np.float64) if table.num_rows else np.zeros(0)
    lengths = pc.list_value_length(table["completion_ids"]).to_numpy(zero_copy_only=False) \
        if table.num_rows else np.zeros(0, np.int64)
    n, c = counts
    per_rank = {}
    for rank, m in sorted(manifests.items()):
        per_rank[str(rank)] = {
            "generation": generations[rank], "tasks": len(m.task_ids), "samples": m.samples,
            "completion_tokens": m.completion_tokens, "generated_samples": m.generated_samples,
            "generated_tokens": m.generated_tokens, "seconds": m.seconds, "chunks": len(m.chunks),
            "resumed_tasks": m.resumed_tasks,
            "tokens_per_s": m.generated_tokens / m.seconds if m.seconds > 0 else 0.0,
            "samples_per_s": m.generated_samples / m.seconds if m.seconds > 0 else 0.0,
            "generated_turns": m.generated_turns,
            "turns_per_s": m.generated_turns / m.seconds if m.seconds > 0 else 0.0,
            "generation_seconds": m.generation_seconds, "env_wait_seconds": m.env_wait_seconds,
            "env_seconds": m.env_seconds, "env_calls": m.env_calls,
        }
    wall = max((m.seconds for m in manifests.values()), default=0.0)
    stats: dict[str, Any] = {
        "split": split, "iteration": iteration, "group_size": group_size, "success_reward": success_reward,
        "tasks": int(n.size), "samples": table.num_rows,
        "reward_mean": float(rewards.mean()) if rewards.size else 0.0,
        "reward_std": float(rewards.std()) if rewards.size else 0.0,
        "pass_at_1": pass_at_k(n, c, 1) if n.size else 0.0,
        f"pass_at_{group_size}": pass_at_k(n, c, group_size) if n.size else 0.0,
        "groups_all_solved": float(np.mean(c == n)) if n.size else 0.0,
        "groups_none_solved": float(np.mean(c == 0)) if n.size else 0.0,
        "completion_tokens": _length_stats(lengths),
        "truncated": float(np.mean(pc.equal(table["finish_reason"], "length").to_numpy(zero_copy_only=False)))
        if table.num_rows else 0.0,
        # Samples whose reward ran past tasks.reward_timeout (reward 0, not trained on).
        "reward_timeouts": int(pc.sum(pc.equal(table["finish_reason"], TIMED_OUT)).as_py() or 0)
        if table.num_rows else 0,
        "episodes": {**_episode_stats(table, success_reward), **_time_split(manifests.values())},
        "wall_seconds": wall,
        "tokens_per_s": sum(m.generated_tokens for m in manifests.values()) / wall if wall > 0 else 0.0,
        "per_rank": per_rank,
    }
    if split == "eval":
        stats["eval"] = eval_metrics(table, group_size=group_size, success_reward=success_reward)
    return stats


def _stored(layout: RunLayout, split: str, iteration: int, run_id: str, key: dict[str, Any]) -> dict | None:
    """The stored stats when both outputs exist, belong to this run and were made from the same inputs."""
    rec = read_or_none(layout.rollout_stats(split, iteration), kind=STATS_KIND, run_id=run_id)
    if rec is None or rec.data.get("inputs") != key:
        return None
    try:
        rows = parquet_rows(layout.rollout_all(split, iteration))
    except (OSError, pa.ArrowInvalid):
        return None
    return rec.data if rows == rec.data.get("samples") else None


def aggregate(layout: RunLayout, split: str, iteration: int, *, ranks: Mapping[int, int], run_id: str,
              expected: Mapping[int, Sequence[str]] | None = None, group_size: int,
              success_reward: float = 1.0, generation: int | None = None) -> dict[str, Any]:
    """Merge the current chunks of `ranks` (rank -> current generation) into all.parquet and
    stats.json; return the stats. `generation` tags stats.json (default: that of the lowest rank,
    the master). Idempotent: outputs already made from the same inputs are returned as they are."""
    t0 = time.monotonic()
    if not ranks:
        raise AggregationError("no ranks to aggregate")
    key = {"ranks": {str(r): int(g) for r, g in sorted(ranks.items())}, "group_size": group_size,
           "success_reward": success_reward, "expected": _expected_digest(expected)}
    stored = _stored(layout, split, iteration, run_id, key)
    if stored is not None:
        return stored
    tables, manifests = [], {}
    for rank, gen in sorted(ranks.items()):
        share = None if expected is None else expected.get(rank, [])
        table, manifests[rank] = _rank_table(layout, split, iteration, rank, gen, run_id, share, group_size)
        tables.append(table)
    merged = pa.concat_tables(tables)
    counts = _group_counts(merged, layout, split, iteration, group_size, success_reward)
    stats = compute_stats(merged, counts, manifests, ranks, split=split, iteration=iteration, group_size=group_size,
                          success_reward=success_reward)
    stats["inputs"] = key
    merged = merged.replace_schema_metadata({store.RUN_ID_KEY: run_id.encode()})
    store.write_table(layout.rollout_all(split, iteration), merged)
    stats["aggregate_seconds"] = time.monotonic() - t0
    gen = ranks[min(ranks)] if generation is None else generation
    publish_record(layout.rollout_stats(split, iteration), STATS_KIND, stats, run_id=run_id, generation=gen)
    _log.info("%s iter %d aggregated: %d tasks, %d samples, reward %.3f, pass@1 %.3f, %.2f s", split, iteration,
              stats["tasks"], stats["samples"], stats["reward_mean"], stats["pass_at_1"], stats["aggregate_seconds"])
    return stats
