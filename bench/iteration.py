"""`python -m bench --what iteration [--json]`: what an RL iteration costs with a resident trainer
against torchrun started anew every iteration (train.resident=false), in one run.

One node, the tiny Llama of train/tiny.py, arithmetic tasks, N iterations of P prompts x G samples
and S optimizer steps through `scripts/run.sh` (the whole program, as a user runs it), once per
mode, alternating the modes over --repeats rounds so that a change in the machine's load touches
both. Reported: whole-process wall times, per-phase medians over iterations (from the runs'
timelines: a phase's work plus its barrier wait) and their medians over rounds.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from coordination.layout import RunLayout
from coordination.records import read_record
from coordination.report import load_spans
from rollout.tasks import arithmetic_tasks, write_tasks
from train.tiny import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
MODES = {"resident": "train.resident=true", "restart": "train.resident=false"}
REWARD = "bench.iteration:digit_share"


def digit_share(task, completion_text: str, finish_reason: str) -> float:
    """The benchmark's reward: the share of digits in the completion. The untrained tiny model
    never answers a task right, so the arithmetic reward would give every group zero advantage
    and the iterations nothing to train; this dense reward varies within every group, so each
    iteration trains all its optimizer steps."""
    return sum(c.isdigit() for c in completion_text) / len(completion_text) if completion_text else 0.0


def _assets(root: Path) -> tuple[Path, Path]:
    data, model = root / "data", root / "model"
    train, ev = arithmetic_tasks(2000, 50, digits=2, seed=3)
    data.mkdir(parents=True)
    write_tasks(data / "train.jsonl", train)
    write_tasks(data / "eval.jsonl", ev)
    write_tiny_model(model, layers=2, seed=1)
    return data, model


def rank0_phase_seconds(log_path: Path) -> dict[int, list[float]]:
    """Seconds each phase took per iteration on rank 0 (work and barrier wait together)."""
    per: dict[tuple[int, int], float] = {}
    for s in load_spans(RunLayout(log_path)):
        if s["rank"] == 0:
            key = (s["phase"], s["iteration"])
            per[key] = per.get(key, 0.0) + s["end"] - s["start"]
    out: dict[int, list[float]] = {}
    for (phase, _), seconds in sorted(per.items()):
        out.setdefault(phase, []).append(seconds)
    return out


def trained_steps(log_path: Path, iterations: int) -> list[int]:
    """Optimizer steps in each iteration's training plan."""
    layout = RunLayout(log_path)
    return [len(read_record(layout.training_plan(i)).data["steps"]) for i in range(1, iterations + 1)]


def run_once(root: Path, data: Path, model: Path, mode: str, opts: dict[str, Any], name: str) -> dict[str, Any]:
    """One whole `scripts/run.sh --master` run; its wall time and per-phase medians."""
    log_path = root / name
    log_path.mkdir(mode=0o750)
    cmd = ["bash", str(REPO / "scripts" / "run.sh"), "--master", "--rl-phase", "both", "--eval-interval", "0", "--data-path", str(data), "--log-path",
           str(log_path), f"model.path={model}", MODES[mode], f"run.max_iterations={opts['iterations']}",
           f"tasks.tasks_per_iteration={opts['prompts']}", f"rollout.group_size={opts['samples']}",
           f"train.steps_per_iteration={opts['steps']}", "rollout.max_new_tokens=6", "logging.wandb.mode=disabled",
           f"tasks.reward={REWARD}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(opts["threads"])}
    started = time.monotonic()
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=opts["timeout"],
                         start_new_session=True)
    wall = time.monotonic() - started
    if res.returncode != 0:
        tail = res.stdout.decode(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{mode} run exited {res.returncode} ({log_path}):\n" + "\n".join(tail))
    phases = rank0_phase_seconds(log_path)
    steps = trained_steps(log_path, opts["iterations"])
    if any(n != opts["steps"] for n in steps):
        raise RuntimeError(f"{mode} run trained {steps} optimizer steps per iteration, not {opts['steps']} "
                           f"({log_path}): the measurement would not be of the work it names")
    return {"wall_s": wall, "phase_median_s": {p: statistics.median(v) for p, v in phases.items()},
            "phase10_s": phases.get(10, [])}


def run_iteration_bench(opts: dict[str, Any], root: Path, echo) -> dict[str, Any]:
    data, model = _assets(root)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(opts["repeats"]):
        for mode in (MODES if r % 2 == 0 else list(MODES)[::-1]):
            res = run_once(root, data, model, mode, opts, f"{mode}-{r}")
            runs[mode].append(res)
            echo(f"round {r + 1}/{opts['repeats']} {mode}: {res['wall_s']:.1f} s, phase 10 "
                 + ", ".join(f"{s:.2f}" for s in res["phase10_s"]) + " s")

    def med(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    def summary(mode: str) -> dict[str, Any]:
        walls = [r["wall_s"] for r in runs[mode]]
        phases = sorted({p for r in runs[mode] for p in r["phase_median_s"]})
        return {"wall_s": walls, "wall_range_s": [round(min(walls), 3), round(max(walls), 3)],
                "phase_median_s": {str(p): med([r["phase_median_s"][p] for r in runs[mode] if p in r["phase_median_s"]])
                                   for p in phases}}

    res, rst = summary("resident"), summary("restart")
    p10 = {m: med([s for r in runs[m] for s in r["phase10_s"]]) for m in MODES}
    return {"machine": f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} at the end",
            "settings": {k: opts[k] for k in ("iterations", "prompts", "samples", "steps", "threads", "repeats")},
            "resident_wall_s": med(res["wall_s"]), "restart_wall_s": med(rst["wall_s"]),
            "ratio": round(statistics.median(res["wall_s"]) / statistics.median(rst["wall_s"]), 3),
            "phase10_median_s": p10, "resident": res, "restart": rst}
