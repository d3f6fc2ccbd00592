"""Helpers of the end-to-end tests: a tiny model and task set made once per session, and the
scripts/run.sh command lines of the nodes."""
from __future__ import annotations

import os
from pathlib import Path

from tests.procs import ROOT

RUN_SH = str(ROOT / "scripts" / "run.sh")

# Small and fast, on the real code paths: 2 iterations, 24 tasks x 4 samples, FSDP on gloo.
FAST = ["tasks.tasks_per_iteration=24", "tasks.eval_tasks=16", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "rollout.chunk_groups=4", "rollout.prompts_per_call=8",
        "tasks.reward=tests.e2e_rewards:starts_with_digit", "train.steps_per_iteration=2",
        "coordination.heartbeat_interval=0.5", "coordination.peer_timeout=6", "coordination.rejoin_timeout=120",
        "logging.wandb.mode=disabled"]


def make_assets(root: Path) -> tuple[Path, Path]:
    """(data folder, model folder) under `root`, built once."""
    from rollout.tasks import arithmetic_tasks, write_tasks
    from train.tiny import write_tiny_model

    data, model = root / "data", root / "model"
    if not (data / "eval.jsonl").exists():
        train, ev = arithmetic_tasks(600, 40, digits=2, seed=3)
        data.mkdir(parents=True, exist_ok=True)
        write_tasks(data / "train.jsonl", train)
        write_tasks(data / "eval.jsonl", ev)
    if not (model / "config.json").exists():
        write_tiny_model(model, layers=2, seed=1)
    return data, model


def node_cmd(data: Path, model: Path, log: Path, *flags: str, overrides: tuple[str, ...] = ()) -> list[str]:
    return [RUN_SH, "--data-path", str(data), "--log-path", str(log), *flags, f"model.path={model}",
            *FAST, *overrides]


def fresh_log(tmp: Path, name: str = "run") -> Path:
    p = tmp / name
    p.mkdir(mode=0o750)
    os.chmod(p, 0o750)
    return p
