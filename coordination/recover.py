"""`python -m coordination recover --log-path L [--apply] [--reset-phase ITER:PHASE]`

Cleans up after crashed nodes, safely. Without `--apply` it only lists what it would touch.
It removes:
- temp files left by writers that died mid-publish (`.name.tmp-host-pid-xxxx`);
- checkpoint staging folders that were never published (unfinished training attempts).
It never removes claim files (the generation history that fences stale processes, docs/design.md
§5 rule 7) nor completed outputs (published checkpoints, aggregated rollouts, chunks, DONE
manifests, metrics). `--reset-phase ITER:PHASE` removes that phase's barrier folders and those
of the later phases of that iteration, so the phase runs again when the nodes restart — the safe
form of the reference pipeline's "delete the flag files" habit. It refuses to change anything
while a node of the run looks alive.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from coordination.layout import JOBS, RunLayout, iteration_number
from coordination.phases import BY_NUMBER
from coordination.records import RecordError, is_temp_name, publish_record, try_read
from coordination.status import StatusReader


class RecoverRefused(RuntimeError):
    pass


@dataclass
class Item:
    path: Path
    why: str


def _temp_files(root: Path, min_age: float) -> list[Item]:
    out = []
    now = time.time()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            if is_temp_name(n):
                p = Path(dirpath) / n
                try:
                    age = now - p.lstat().st_mtime
                except FileNotFoundError:
                    continue
                if age >= min_age:
                    out.append(Item(p, f"temp file of a writer that did not finish ({age:.0f} s old)"))
    return out


def _staging(layout: RunLayout) -> list[Item]:
    d = layout.checkpoint_staging_dir
    if not d.exists():
        return []
    return [Item(p, "checkpoint staging folder of an unfinished training attempt") for p in sorted(d.iterdir())]


def _reset_items(layout: RunLayout, spec: str) -> tuple[list[Item], dict[str, int]]:
    try:
        it_s, ph_s = spec.split(":")
        iteration, phase = int(it_s), int(ph_s)
    except ValueError:
        raise RecoverRefused(f"--reset-phase {spec!r} must be ITER:PHASE, for example 3:10") from None
    if phase not in BY_NUMBER:
        raise RecoverRefused(f"--reset-phase {spec}: there is no phase {phase} (phases are 0-13)")
    items, rollback = [], {}
    for job in JOBS:
        sync = layout.job(job).sync_iter_dir(iteration)
        if not sync.exists():
            continue
        later = [n for d in sync.parent.iterdir() if (n := iteration_number(d.name)) is not None and n > iteration]
        if later:
            raise RecoverRefused(
                f"--reset-phase {spec}: job {job} already ran iteration {max(later)}; resetting an older iteration "
                f"would leave later ones decided on its old outputs. Reset the latest iteration, or start a new run.")
        for d in sorted(sync.iterdir()):
            num = int(d.name.split("-", 1)[0])
            if num >= phase:
                items.append(Item(d, f"flag folder of phase {num} of iteration {iteration} (job {job})"))
                rollback[job] = iteration - 1
    if not items:
        raise RecoverRefused(f"--reset-phase {spec}: iteration {iteration} has no flag folders at or after phase "
                             f"{phase} (it never ran there, or was garbage-collected)")
    return items, rollback


def plan(log_path: Path, reset_phase: str | None = None, peer_timeout: float = 120.0,
         temp_min_age: float = 60.0) -> tuple[list[Item], dict[str, int], dict]:
    layout = RunLayout(log_path)
    snap = StatusReader(layout, peer_timeout).snapshot()
    items = _temp_files(layout.root, temp_min_age) + _staging(layout)
    rollback: dict[str, int] = {}
    if reset_phase:
        extra, rollback = _reset_items(layout, reset_phase)
        items += extra
    return items, rollback, snap


def apply(log_path: Path, items: list[Item], rollback: dict[str, int], snap: dict) -> None:
    live = [f"rank {r['rank']} of job {j['job']} (host {r['host']}, pid {r['pid']})"
            for j in snap["jobs"] for r in j["ranks"] if r["state"] == "alive"]
    if live:
        raise RecoverRefused("these nodes look alive, stop them before recovering: " + "; ".join(live))
    layout = RunLayout(log_path)
    for it in items:
        if it.path.is_dir() and not it.path.is_symlink():
            shutil.rmtree(it.path)
        else:
            it.path.unlink(missing_ok=True)
    run = try_read(layout.run_json, kind="run")
    for job, completed in rollback.items():
        jl = layout.job(job)
        try:
            prog = try_read(jl.progress_json, kind="progress", run_id=run.run_id)
        except RecordError:
            prog = None
        if prog is not None and int(prog.data["completed_iteration"]) > completed:
            publish_record(jl.progress_json, "progress", {"completed_iteration": completed, "stopped": None},
                           run_id=run.run_id, generation=prog.generation)
