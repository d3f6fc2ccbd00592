"""`python -m coordination status --log-path L [--watch] [--json]`: what the cluster is doing.

Read-only: it never writes to the log path. One snapshot judges a heartbeat by its age on the
writer's clock (approximate: node clocks may differ); `--watch` judges liveness exactly as the
nodes do, by seeing heartbeat counters change on this machine's monotonic clock.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coordination.heartbeat import KIND as HEARTBEAT_KIND, LivenessTracker
from coordination.layout import JOBS, RunLayout, iteration_number
from coordination.phases import phase_name
from coordination.records import RecordError, try_read


@dataclass
class RankRow:
    job: str
    rank: int
    host: str | None
    pid: int | None
    generation: int | None
    iteration: int | None
    phase: int | None
    phase_name: str
    heartbeat_age_s: float | None   # seconds since the counter last moved, as this observer judges it
    state: str                      # alive | lost | exited | failed | stopped | never-joined
    message: str
    waiting_for: list[int] = field(default_factory=list)


@dataclass
class JobStatus:
    job: str
    num_nodes: int
    completed_iteration: int
    stopped: str | None
    ranks: list[RankRow]
    waiting: str


def _read(path: Path, kind: str, run_id: str | None):
    try:
        return try_read(path, kind=kind, run_id=run_id)
    except RecordError:
        return None


def _latest_metrics(layout: RunLayout) -> dict[str, Any] | None:
    if not layout.metrics_dir.exists():
        return None
    its = sorted((n, p) for p in layout.metrics_dir.iterdir() if (n := iteration_number(p.stem)) is not None)
    for n, p in reversed(its):
        try:
            rec = try_read(p, kind="metrics")
        except RecordError:
            rec = None
        if rec is not None:
            return dict(rec.data, iteration=n)
    return None


class StatusReader:
    """Builds status snapshots; keeps a LivenessTracker between snapshots for `--watch`."""

    def __init__(self, layout: RunLayout, peer_timeout: float = 120.0):
        self.layout = layout
        self.peer_timeout = peer_timeout
        self.tracker = LivenessTracker(peer_timeout)
        self.snapshots = 0

    def snapshot(self) -> dict[str, Any]:
        run = _read(self.layout.run_json, "run", None)
        if run is None:
            raise FileNotFoundError(f"no baton run in {self.layout.root} (no readable run.json); check --log-path")
        run_id = run.run_id
        self.snapshots += 1
        jobs = []
        for name in JOBS:
            jl = self.layout.job(name)
            job = _read(jl.job_json, "job", run_id)
            if job is None:
                continue
            prog = _read(jl.progress_json, "progress", run_id)
            rows = [self._rank_row(jl, name, r, run_id) for r in range(int(job.data["num_nodes"]))]
            jobs.append(JobStatus(name, int(job.data["num_nodes"]),
                                  int(prog.data["completed_iteration"]) if prog else 0,
                                  prog.data.get("stopped") if prog else None, rows, self._waiting(rows)))
        return {"log_path": str(self.layout.root), "run_id": run_id, "jobs": [asdict(j) for j in jobs],
                "latest_metrics": _latest_metrics(self.layout),
                "stop_requested": self.layout.stop_file.exists()}

    def _rank_row(self, jl, job: str, rank: int, run_id: str) -> RankRow:
        gens = jl.claim_generations(rank)
        claim = _read(jl.claim(rank, gens[-1]), "claim", None) if gens else None
        hb = _read(jl.heartbeat(rank), HEARTBEAT_KIND, run_id)
        if hb is not None and gens and hb.generation < gens[-1]:
            hb = None  # written by a superseded generation
        if hb is None:
            state = "never-joined" if not gens else "lost"
            return RankRow(job, rank, claim.data.get("host") if claim else None,
                           claim.data.get("pid") if claim else None, gens[-1] if gens else None,
                           None, None, "-", None, state, "no heartbeat")
        d = hb.data
        view = self.tracker.observe(rank + 1000 * JOBS.index(job), hb)
        if self.snapshots > 1 and view.last_change > view.first_seen:
            age = view.silent_for  # exact: seen moving on this machine's clock
        else:
            age = max(0.0, time.time() - float(d.get("wall", 0.0)))  # approximate: writer's clock
        state = d.get("state", "running")
        if state == "running":
            state = "lost" if age > self.peer_timeout else "alive"
        return RankRow(job, rank, d.get("host"), d.get("pid"), hb.generation, d.get("iteration"), d.get("phase"),
                       d.get("phase_name") or phase_name(d.get("phase")), round(age, 1), state,
                       d.get("message") or "", list(d.get("waiting_for") or []))

    @staticmethod
    def _waiting(rows: list[RankRow]) -> str:
        master = rows[0]
        if master.state not in ("alive",):
            return f"the master is {master.state}: {master.message}"
        if master.waiting_for:
            parts = []
            for r in master.waiting_for:
                row = next((x for x in rows if x.rank == r), None)
                if row is None:
                    continue
                parts.append(f"rank {r} (host {row.host or '?'}), {row.state}, {row.message}")
            where = f"barrier {master.phase} {master.phase_name}"
            return f"{where}: waiting for " + "; ".join(parts)
        if any(r.message.startswith("waiting at") and "GO" in r.message for r in rows[1:]):
            return f"workers wait for the master, which is in phase {master.phase} {master.phase_name}: {master.message}"
        return master.message


def render(snap: dict[str, Any]):
    """A rich renderable for one snapshot."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(f"run {snap['run_id']} in {snap['log_path']}", style="bold")]
    m = snap.get("latest_metrics")
    if m:
        bits = [f"iteration {m['iteration']}"]
        for key, label in (("train_reward_mean", "train reward"), ("eval_accuracy", "eval accuracy")):
            if m.get(key) is not None:
                bits.append(f"{label} {m[key]:.3f}")
        parts.append(Text("last metrics: " + ", ".join(bits)))
    if snap.get("stop_requested"):
        parts.append(Text("a stop was requested: the run ends after the current iteration", style="yellow"))
    colors = {"alive": "green", "lost": "red", "failed": "red", "exited": "cyan", "stopped": "cyan",
              "never-joined": "yellow"}
    for job in snap["jobs"]:
        t = Table(title=f"job {job['job']}: {job['num_nodes']} nodes, {job['completed_iteration']} iterations done"
                        + (f", stopped ({job['stopped']})" if job["stopped"] else ""), title_justify="left")
        for col in ("rank", "host", "pid", "gen", "iter", "phase", "heartbeat", "state"):
            t.add_column(col, no_wrap=True)
        t.add_column("message", no_wrap=True, overflow="ellipsis", max_width=70)
        for r in job["ranks"]:
            age = "-" if r["heartbeat_age_s"] is None else f"{r['heartbeat_age_s']:.0f} s ago"
            phase = "-" if r["phase"] is None else f"{r['phase']} {r['phase_name']}"
            t.add_row(str(r["rank"]), r["host"] or "-", str(r["pid"] or "-"), str(r["generation"] or "-"),
                      str(r["iteration"] or "-"), phase, age,
                      Text(r["state"], style=colors.get(r["state"], "")), r["message"])
        parts.append(t)
        parts.append(Text(f"now: {job['waiting']}"))
    return Group(*parts)


def print_status(log_path: Path, *, as_json: bool, watch: bool, interval: float = 2.0,
                 peer_timeout: float = 120.0) -> None:
    from rich.console import Console

    reader = StatusReader(RunLayout(log_path), peer_timeout)
    console = Console()
    if as_json:
        print(json.dumps(reader.snapshot(), indent=1, default=str))
        return
    if not watch:
        console.print(render(reader.snapshot()))
        return
    from rich.live import Live

    with Live(render(reader.snapshot()), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            live.update(render(reader.snapshot()))
