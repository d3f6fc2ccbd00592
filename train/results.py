"""Result records of a training attempt: one per trainer rank, read back by the driver.

Each rank publishes `training/iter-N/attempt-A/result-rank-R.json` ("training-result"): ok or the
error, the per-step metrics (global values, identical on every rank, plus the rank's own time
and peak memory) and the iteration summary the driver copies into metrics/iter-N.json.
"""
from __future__ import annotations

from typing import Any

from coordination.layout import RunLayout
from coordination.records import publish_record, try_read

KIND = "training-result"


def write_result(layout: RunLayout, iteration: int, attempt: int, rank: int, run_id: str, data: dict[str, Any]) -> None:
    publish_record(layout.training_result(iteration, attempt, rank), KIND,
                   {"rank": rank, "attempt": attempt, "iteration": iteration, **data}, run_id=run_id, generation=0)


def summarise(steps: list[dict[str, Any]], plan: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The iteration's training metrics: means over steps, last lr, global throughput, this rank's
    peak memory (and the highest of any rank), the plan's data statistics."""
    def mean(key: str) -> float | None:
        return sum(s[key] for s in steps) / len(steps) if steps else None

    tokens = sum(s["tokens"] for s in steps)
    busy = sum(s["seconds"] for s in steps)
    return {"steps": len(steps), "loss": mean("loss"), "entropy": mean("entropy"),
            "clip_fraction": mean("clip_fraction"), "kl": mean("kl"), "grad_norm": mean("grad_norm"),
            "aux_loss": mean("aux_loss"),
            "lr": steps[-1]["lr"] if steps else None, "tokens": tokens,
            "tokens_per_s": tokens / busy if steps and busy > 0 else None,
            "peak_memory_mb": max((s["local_peak_memory_mb"] for s in steps), default=None),
            "peak_memory_mb_any_rank": max((s["peak_memory_mb"] for s in steps), default=None),
            "seconds": seconds, **{f"data_{k}": v for k, v in plan.get("stats", {}).items()}}


def read_results(layout: RunLayout, iteration: int, attempt: int, world_size: int, *,
                 run_id: str | None = None) -> dict[str, Any]:
    """What the driver needs after an attempt: {"ok", "summary" (rank 0's), "errors" {rank: text},
    "missing" [ranks without a record]}."""
    records = {r: try_read(layout.training_result(iteration, attempt, r), kind=KIND, run_id=run_id)
               for r in range(world_size)}
    missing = [r for r, rec in records.items() if rec is None]
    errors = {r: rec.data.get("error", "") for r, rec in records.items() if rec is not None and not rec.data["ok"]}
    first = records.get(0)
    return {"ok": not missing and not errors, "missing": missing, "errors": errors,
            "summary": first.data.get("summary") if first is not None and first.data["ok"] else None}
