"""`python -m coordination status --log-path L [--watch] [--json]`: what the cluster is doing.

Read-only: it never writes to the log path. Liveness is judged as the nodes judge it (docs/design.md
§5 rule 6): by seeing heartbeat counters change on *this* machine's monotonic clock, never by the
wall time a heartbeat carries (node clocks may differ by minutes). So a single look cannot tell
a live rank from a dead one: one-shot `status` watches for up to two heartbeat intervals and says
which counters moved meanwhile; a rank is called lost only after its counter stood still for
`peer_timeout` of this observer's time (`--watch`, `recover`). A rank whose last heartbeat says
it exited, failed or stopped is reported so at once.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from coordination.clock import Clock
from coordination.config import CoordinationConfig
from coordination.heartbeat import KIND as HEARTBEAT_KIND, LivenessTracker
from coordination.layout import JOBS, RunLayout
from coordination.manifest import read_config_yaml
from coordination.metrics import iteration_metrics
from coordination.phases import phase_name
from coordination.records import read_or_none


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
    heartbeat_age_s: float | None   # seconds since the counter last moved (or since watching began), this clock
    state: str                      # alive | not moving | lost | exited | failed | stopped | never-joined
    message: str
    waiting_for: list[int] = field(default_factory=list)
    watched_s: float = 0.0          # how long this observer has watched the rank's heartbeat
    beat: list | None = None        # [nonce, counter, generation] last read: recover re-checks it before deleting
    trainer: list = field(default_factory=list)  # resident trainer processes: pid, state, iteration, device memory


# States a rank cannot be in while it still runs; anything else may be a live process.
GONE = ("lost", "exited", "failed", "stopped", "never-joined")
FINAL = ("exited", "failed", "stopped")  # the rank's own last heartbeat said so: no need to wait


def run_timings(layout: RunLayout) -> tuple[float, float]:
    """(heartbeat_interval, peer_timeout) of the run in `layout`, from its config.yaml; the
    defaults of coordination.* when it cannot be read."""
    interval, timeout = CoordinationConfig.heartbeat_interval, CoordinationConfig.peer_timeout
    try:
        coord = (read_config_yaml(layout) or {}).get("coordination") or {}
        return float(coord.get("heartbeat_interval", interval)), float(coord.get("peer_timeout", timeout))
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return interval, timeout  # an unreadable config.yaml: the documented defaults (--peer-timeout overrides)


@dataclass
class JobStatus:
    job: str
    num_nodes: int
    completed_iteration: int
    stopped: str | None
    ranks: list[RankRow]
    waiting: str


def _trainer_states(jl, rank: int, run_id: str) -> list[dict[str, Any]]:
    """The resident trainer processes of node `rank` (train/resident.py writes `state-L.json` per
    local rank, the record kind "resident-trainer"): local ranks 0, 1, ... up to the first missing."""
    out = []
    for local in range(1024):
        rec = read_or_none(jl.trainer_state(rank, local), kind="resident-trainer", run_id=run_id)
        if rec is None:
            break
        d = rec.data
        out.append({"local_rank": local, "pid": d.get("pid"), "state": d.get("state"),
                    "iteration": d.get("iteration"), "device_memory_mb": d.get("device_memory_mb"),
                    "launch": d.get("launch")})
    return out


def trainer_line(rank: int, states: list[dict[str, Any]]) -> str:
    """`rank 0 trainer: pid 812 idle after iteration 3 (device memory 0.0 MiB)`, one part per process."""
    parts = []
    for s in states:
        mem = f", device memory {s['device_memory_mb']:.1f} MiB" if isinstance(s.get("device_memory_mb"), (int, float)) else ""
        it = f" (iteration {s['iteration']})" if s.get("iteration") is not None else ""
        parts.append(f"pid {s['pid']} {s['state']}{it}{mem}")
    return f"  rank {rank} trainer: " + "; ".join(parts)


def _latest_metrics(layout: RunLayout) -> dict[str, Any] | None:
    return next(iteration_metrics(layout, newest_first=True), None)


def _last_values(layout: RunLayout) -> dict[str, dict[str, Any]]:
    """The newest train reward and eval accuracy, each from the newest iteration that has it: the
    final evaluation-only iteration has no train reward, most iterations no eval."""
    out: dict[str, dict[str, Any]] = {}
    for m in iteration_metrics(layout, newest_first=True):
        for key in ("train_reward_mean", "eval_accuracy"):
            if key not in out and isinstance(m.get(key), (int, float)):
                out[key] = {"value": m[key], "iteration": m["iteration"],
                            "checkpoint": m.get("policy_iteration", m["iteration"] - 1)}
        if len(out) == 2:
            break
    return out


class StatusReader:
    """Builds status snapshots; keeps a LivenessTracker between snapshots for `--watch`."""

    def __init__(self, layout: RunLayout, peer_timeout: float | None = None, clock: Clock | None = None,
                 heartbeat_interval: float | None = None):
        self.layout = layout
        interval, timeout = run_timings(layout)
        self.peer_timeout = peer_timeout if peer_timeout is not None else timeout
        self.heartbeat_interval = heartbeat_interval if heartbeat_interval is not None else interval
        self.clock = clock or Clock()
        self.tracker = LivenessTracker(self.peer_timeout, self.clock)
        self.snapshots = 0

    def watch(self, seconds: float, *, until=None, progress=None, progress_every: float = 10.0,
              poll: float | None = None) -> dict[str, Any]:
        """Snapshots for up to `seconds` of this observer's clock, until every rank is judged
        (moving, exited, or still for `peer_timeout`) or `until(snapshot)` says enough; the last
        snapshot is returned. `progress(snapshot, elapsed)` is called every `progress_every` s."""
        poll = poll if poll is not None else max(0.05, min(0.5, self.heartbeat_interval / 4))
        start = self.clock.monotonic()
        # One poll past the bound, so a rank still at `seconds` is seen past peer_timeout.
        end = start + seconds + poll
        next_note = start + progress_every
        while True:
            snap = self.snapshot()
            now = self.clock.monotonic()
            snap["watched_s"] = round(now - start, 1)
            undecided = [r for j in snap["jobs"] for r in j["ranks"] if r["state"] == "not moving"]
            if not undecided or now >= end or (until is not None and until(snap)):
                return snap
            if progress is not None and now >= next_note:
                progress(snap, now - start)
                next_note = now + progress_every
            self.clock.sleep(min(poll, end - now))

    def snapshot(self) -> dict[str, Any]:
        run = read_or_none(self.layout.run_json, kind="run")
        if run is None:
            raise FileNotFoundError(f"no baton run in {self.layout.root} (no readable run.json); check --log-path")
        run_id = run.run_id
        self.snapshots += 1
        jobs = []
        for name in JOBS:
            jl = self.layout.job(name)
            job = read_or_none(jl.job_json, kind="job", run_id=run_id)
            if job is None:
                continue
            prog = read_or_none(jl.progress_json, kind="progress", run_id=run_id)
            rows = [self._rank_row(jl, name, r, run_id) for r in range(int(job.data["num_nodes"]))]
            for row in rows:
                row.trainer = _trainer_states(jl, row.rank, run_id)
            jobs.append(JobStatus(name, int(job.data["num_nodes"]),
                                  int(prog.data["completed_iteration"]) if prog else 0,
                                  prog.data.get("stopped") if prog else None, rows, self._waiting(rows)))
        return {"log_path": str(self.layout.root), "run_id": run_id, "jobs": [asdict(j) for j in jobs],
                "peer_timeout": self.peer_timeout,
                "latest_metrics": _latest_metrics(self.layout), "last_values": _last_values(self.layout),
                "stop_requested": self.layout.stop_file.exists()}

    def _rank_row(self, jl, job: str, rank: int, run_id: str) -> RankRow:
        gens = jl.claim_generations(rank)
        claim = read_or_none(jl.claim(rank, gens[-1]), kind="claim") if gens else None
        hb = read_or_none(jl.heartbeat(rank), kind=HEARTBEAT_KIND, run_id=run_id)
        if not gens and hb is None:
            return RankRow(job, rank, None, None, None, None, None, "-", None, "never-joined", "no heartbeat")
        # A superseded generation's heartbeat is no sign of life of the rank (min_generation).
        view = self.tracker.observe(rank + 1000 * JOBS.index(job), hb, min_generation=gens[-1] if gens else 0)
        watched = view.silent_for + (view.last_change - view.first_seen)
        rec = view.record if view.record is not None and (not gens or view.record.generation >= gens[-1]) else None
        if rec is None:
            state = "lost" if view.lost else "not moving"
            return RankRow(job, rank, claim.data.get("host") if claim else None,
                           claim.data.get("pid") if claim else None, gens[-1] if gens else None,
                           None, None, "-", round(view.silent_for, 1), state, "no heartbeat",
                           watched_s=round(watched, 1))
        d = rec.data
        state = d.get("state", "running")
        if state not in FINAL:
            # Never the writer's wall time: only a change seen on this clock shows life.
            if view.lost:
                state = "lost"
            elif view.last_change > view.first_seen:
                state = "alive"
            else:
                state = "not moving"
        return RankRow(job, rank, d.get("host"), d.get("pid"), rec.generation, d.get("iteration"), d.get("phase"),
                       d.get("phase_name") or phase_name(d.get("phase")), round(view.silent_for, 1), state,
                       d.get("message") or "", list(d.get("waiting_for") or []), round(watched, 1),
                       [d.get("nonce"), d.get("counter"), rec.generation])

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


# Columns in display order, and the order in which they are kept when the terminal is narrow:
# rank, iteration, phase and state always fit in 80 columns; messages move under the table.
COLUMNS = ("rank", "host", "pid", "gen", "iter", "phase", "heartbeat", "state", "message")
KEEP_ORDER = ("rank", "iter", "phase", "state", "host", "heartbeat", "message", "pid", "gen")
MESSAGE_MIN, MESSAGE_MAX = 24, 70
COLORS = {"alive": "green", "lost": "red", "failed": "red", "exited": "cyan", "stopped": "cyan",
          "never-joined": "yellow", "not moving": "yellow"}


def _cells(r: dict[str, Any]) -> dict[str, str]:
    if r["heartbeat_age_s"] is None:
        age = "-"
    elif r["state"] == "alive":
        age = f"moved {r['heartbeat_age_s']:.0f} s ago"
    else:
        age = f"still {r['heartbeat_age_s']:.0f} s"
    return {"rank": str(r["rank"]), "host": r["host"] or "-", "pid": str(r["pid"] or "-"),
            "gen": str(r["generation"] or "-"), "iter": str(r["iteration"] or "-"),
            "phase": "-" if r["phase"] is None else f"{r['phase']} {r['phase_name']}", "heartbeat": age,
            "state": r["state"], "message": r["message"] or ""}


def fit_columns(rows: list[dict[str, str]], width: int) -> list[str]:
    """The columns that fit in `width` characters, kept by priority, shown in display order. A
    column costs its widest cell plus 3 (padding and border); the message column wraps, so it
    needs only MESSAGE_MIN."""
    used, kept = 1, set()
    for col in KEEP_ORDER:
        natural = max([len(col)] + [len(r[col]) for r in rows])
        need = (min(natural, MESSAGE_MIN) if col == "message" else natural) + 3
        if used + need <= width:
            kept.add(col)
            used += need
    return [c for c in COLUMNS if c in kept]


def render(snap: dict[str, Any], width: int = 120):
    """A rich renderable for one snapshot, fitted to `width` columns."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text(f"run {snap['run_id']} in {snap['log_path']}", style="bold")]
    last = snap.get("last_values") or {}
    bits = []
    if "train_reward_mean" in last:
        v = last["train_reward_mean"]
        bits.append(f"train reward {v['value']:.3f} (iteration {v['iteration']})")
    if "eval_accuracy" in last:
        v = last["eval_accuracy"]
        bits.append(f"eval accuracy {v['value']:.3f} (checkpoint {v['checkpoint']}, iteration {v['iteration']})")
    if bits:
        parts.append(Text("last " + ", ".join(bits)))
    if snap.get("stop_requested"):
        parts.append(Text("a stop was requested: the run ends after the current iteration", style="yellow"))
    if snap.get("watched_s") is not None:
        parts.append(Text(f"heartbeats watched for {snap['watched_s']:.1f} s on this machine's clock: alive = counter "
                          f"moved meanwhile, not moving = no change yet (lost only after peer_timeout "
                          f"{snap.get('peer_timeout', 0):.0f} s without one)"))
    for job in snap["jobs"]:
        rows = [_cells(r) for r in job["ranks"]]
        cols = fit_columns(rows, width)
        t = Table(title=f"job {job['job']}: {job['num_nodes']} nodes, {job['completed_iteration']} iterations done"
                        + (f", stopped ({job['stopped']})" if job["stopped"] else ""), title_justify="left")
        for col in cols:
            if col == "message":
                t.add_column(col, overflow="fold", max_width=MESSAGE_MAX)
            else:
                t.add_column(col, no_wrap=True)
        for row in rows:
            t.add_row(*[Text(row[c], style=COLORS.get(row[c], "")) if c == "state" else row[c] for c in cols])
        parts.append(t)
        if "message" not in cols:
            parts += [Text(f"  rank {row['rank']}: {row['message']}") for row in rows]
        parts += [Text(trainer_line(r["rank"], r["trainer"])) for r in job["ranks"] if r.get("trainer")]
        parts.append(Text(f"now: {job['waiting']}"))
    return Group(*parts)


def one_shot_watch(reader: StatusReader) -> float:
    """How long a one-shot `status` watches: two heartbeat intervals (every live rank writes at
    least once meanwhile), never longer than peer_timeout."""
    return min(2 * reader.heartbeat_interval + 0.5, reader.peer_timeout)


def print_status(log_path: Path, *, as_json: bool, watch: bool, interval: float = 2.0,
                 peer_timeout: float | None = None) -> None:
    from rich.console import Console

    reader = StatusReader(RunLayout(log_path), peer_timeout)
    console = Console()
    if not watch or as_json:
        seconds = one_shot_watch(reader)
        reader.snapshot()  # a missing run fails here, before the wait
        # Two heartbeat intervals, in under 80 columns for any interval up to a day (rich fits the
        # rest of the output to the terminal's width).
        print(f"watching heartbeats for up to {seconds:.1f} s to see which ranks are alive...",
              file=sys.stderr, flush=True)
        snap = reader.watch(seconds)
        if as_json:
            print(json.dumps(snap, indent=1, default=str))
        else:
            console.print(render(snap, console.width))
        return
    start = reader.clock.monotonic()

    def snap() -> dict[str, Any]:
        out = reader.snapshot()
        out["watched_s"] = round(reader.clock.monotonic() - start, 1)
        return out

    if not console.is_terminal:
        # A pipe or a log file cannot be redrawn in place: a plain snapshot every interval.
        while True:
            console.print(render(snap(), console.width))
            console.print(f"-- {time.strftime('%H:%M:%S')}, next in {interval:g} s --")
            sys.stdout.flush()
            time.sleep(interval)
    from rich.live import Live

    with Live(render(snap(), console.width), console=console, refresh_per_second=4) as live:
        while True:
            time.sleep(interval)
            live.update(render(snap(), console.width))
