"""Metric sinks fed from the per-iteration metrics record, by the master: TensorBoard event files
(`logging.tensorboard: true`) and Weights & Biases (`logging.wandb.mode: offline` by default,
`online`, or `disabled`)."""
from __future__ import annotations

import logging
from typing import Any

from coordination.layout import RunLayout
from coordination.records import ensure_dir, fence_check

log = logging.getLogger("baton.sinks")

_writers: dict[str, Any] = {}


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """Flat name -> number view of a metrics record: top-level numbers, per-rank throughput
    and phase times (so TensorBoard shows stragglers)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("iteration", "policy_iteration"):
            out[f"run/{k}"] = float(v)
    for group in ("rollout_tokens_per_s", "trainer_tokens_per_s", "trainer_peak_memory_mb"):
        for rank, v in (rec.get(group) or {}).items():
            if isinstance(v, (int, float)):
                out[f"{group}/rank{rank}"] = float(v)
    for rank, phases in (rec.get("phase_seconds") or {}).items():
        for name, times in phases.items():
            for kind, secs in times.items():
                out[f"phase_{kind}_s/rank{rank}/{name}"] = float(secs)
    return out


def emit(cfg, layout: RunLayout, rec: dict[str, Any]) -> None:
    fence_check()  # event files live under the log path too (docs/design.md §5 rule 7)
    values = scalars(rec)
    step = int(rec["iteration"])
    if cfg.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        w = _writers.get("tb")
        if w is None:
            # ensure_dir refuses a linked tensorboard/ (docs/design.md §5 rule 11)
            w = _writers["tb"] = SummaryWriter(log_dir=str(ensure_dir(layout.tensorboard_dir)))
        for k, v in values.items():
            w.add_scalar(k, v, step)
        w.flush()
    if cfg.wandb.mode != "disabled":
        import wandb

        run = _writers.get("wandb")
        if run is None:
            ensure_dir(layout.wandb_dir)
            run = _writers["wandb"] = wandb.init(project=cfg.wandb.project, dir=str(layout.wandb_dir),
                                                 mode=cfg.wandb.mode, name=layout.root.name)
        run.log(values, step=step)


def close() -> None:
    """Flush and close the sinks this process opened (at the end of a run)."""
    tb = _writers.pop("tb", None)
    if tb is not None:
        tb.close()
    run = _writers.pop("wandb", None)
    if run is not None:
        run.finish()
