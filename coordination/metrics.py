"""One metrics record per iteration (`metrics/iter-N.json`), written by the master at the end of
the iteration from what the phases published: rollout and eval stats, the trainer ranks'
results and every rank's timeline. Plots, TensorBoard and W&B are all fed from these records."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

from coordination import timeline
from coordination.layout import JobLayout, RunLayout, iteration_number
from coordination.phases import BY_NUMBER
from coordination.records import read_or_none

# Rollout stats copied to the top level of the record (as train_<key>) for plots and status.
ROLLOUT_KEYS = ("reward_mean", "reward_std", "pass_at_1", "groups_all_solved", "groups_none_solved", "truncated",
                "reward_timeouts")
# The episodes' numbers (rollout/aggregate.py `episodes`), top-level so that the sinks plot them.
EPISODE_KEYS = ("success_rate", "turns_mean", "generation_seconds", "env_wait_seconds", "env_seconds", "env_calls")


def iteration_metrics(layout: RunLayout, *, newest_first: bool = False) -> Iterator[dict[str, Any]]:
    """Each iteration's metrics record (its data plus `iteration`), in iteration order; a file that is
    not a whole metrics record (half written, another run's) is skipped. `status` and `report` both
    read the records through this; lazy, so `status` reads back only as far as it needs."""
    if not layout.metrics_dir.exists():
        return
    found = sorted((n, p) for p in layout.metrics_dir.iterdir() if (n := iteration_number(p.stem)) is not None)
    for n, p in reversed(found) if newest_first else found:
        rec = read_or_none(p, kind="metrics")
        if rec is not None:
            yield dict(rec.data, iteration=n)


def _data(path: Path, kind: str | None, run_id: str) -> dict | None:
    rec = read_or_none(path, kind=kind, run_id=run_id)
    return rec.data if rec else None


def phase_seconds(job: JobLayout, num_nodes: int, iteration: int) -> dict[str, dict[str, dict[str, float]]]:
    """rank -> "NN-name" -> {"work": s, "wait": s} for one iteration, from the timelines."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for rank in range(num_nodes):
        open_: dict[tuple, float] = {}
        acc: dict[str, dict[str, float]] = defaultdict(lambda: {"work": 0.0, "wait": 0.0})
        for ev in timeline.read(job.timeline(rank)):
            if ev.get("iteration") != iteration:
                continue
            kind = "wait" if ev["event"].startswith("wait") else "work"
            key = (ev["phase"], ev.get("attempt", 1), kind)
            if ev["event"] in ("start", "wait-start"):
                open_[key] = ev["wall"]
            elif key in open_:
                name = f"{ev['phase']:02d}-{BY_NUMBER[ev['phase']].name}"
                acc[name][kind] += ev["wall"] - open_.pop(key)
        out[str(rank)] = {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in sorted(acc.items())}
    return out


def training_results(layout: RunLayout, iteration: int, attempt: int, run_id: str) -> dict[str, dict]:
    out = {}
    for rank in layout.training_result_ranks(iteration, attempt):
        d = _data(layout.training_result(iteration, attempt, rank), None, run_id)
        if d is not None:
            out[str(rank)] = d
    return out


def build(layout: RunLayout, job: JobLayout, *, run_id: str, iteration: int, num_nodes: int,
          policy_iteration: int | None, train_attempt: int | None, eval_done: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {"iteration": iteration, "job": job.name, "policy_iteration": policy_iteration}
    train = _data(layout.rollout_stats("train", iteration), None, run_id)
    if train:
        rec["rollout"] = train
        for k in ROLLOUT_KEYS:
            rec[f"train_{k}"] = train.get(k)
        rec["train_pass_at_k"] = train.get(f"pass_at_{train.get('group_size')}")
        for k in EPISODE_KEYS:
            rec[f"train_{k}"] = (train.get("episodes") or {}).get(k)
        rec["completion_length_mean"] = (train.get("completion_tokens") or {}).get("mean")
        rec["rollout_tokens_per_s"] = {r: v.get("tokens_per_s") for r, v in (train.get("per_rank") or {}).items()}
    if eval_done:
        ev = _data(layout.rollout_stats("eval", iteration), None, run_id)
        if ev:
            rec["eval"] = ev
            rec["eval_accuracy"] = (ev.get("eval") or {}).get("accuracy")
            rec["eval_pass_at_k"] = (ev.get("eval") or {}).get("pass_at_k")
    if train_attempt is not None:
        results = training_results(layout, iteration, train_attempt, run_id)
        rec["training"] = {"attempt": train_attempt, "ranks": results}
        summary = (results.get("0") or {}).get("summary") or {}
        for key in ("loss", "entropy", "grad_norm", "clip_fraction", "kl", "aux_loss", "lr", "steps"):
            rec[key] = summary.get(key)
        rec["trainer_tokens_per_s"] = {r: (d.get("summary") or {}).get("tokens_per_s") for r, d in results.items()}
        rec["trainer_peak_memory_mb"] = {r: (d.get("summary") or {}).get("peak_memory_mb") for r, d in results.items()}
    rec["phase_seconds"] = phase_seconds(job, num_nodes, iteration)
    return rec
