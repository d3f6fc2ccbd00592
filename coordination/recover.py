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
while a node of the run looks alive, judged as the nodes judge each other (docs/design.md §5
rule 6): it watches the heartbeat counters on this machine's monotonic clock for up to
peer_timeout, and never trusts the wall time a heartbeat carries (clocks differ between nodes).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coordination.clock import Clock
from coordination.heartbeat import KIND as HEARTBEAT_KIND
from coordination.layout import JOBS, LinkInRunFolder, RunLayout, barrier_identity, check_no_links, iteration_number, \
    staging_identity
from coordination.phases import BY_NUMBER, PHASES
from coordination.records import is_temp_name, publish_record, read_or_none, remove_tree, temp_writer, try_read
from coordination.status import GONE, StatusReader


class RecoverRefused(RuntimeError):
    pass


@dataclass
class Item:
    path: Path
    why: str
    refused: str = ""  # set while nodes look alive: why --apply would not remove it now


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
    check_no_links(d)  # a linked .staging would list (and hand over for deletion) another folder's entries
    if not d.exists():
        return []
    return [Item(p, "checkpoint staging folder of an unfinished training attempt") for p in sorted(d.iterdir())
            if staging_identity(p.name) is not None]  # only names baton gives staging folders


class BadResetSpec(RecoverRefused):
    """--reset-phase names something that cannot be reset: not ITER:PHASE, an iteration that
    never ran that phase, or one that later iterations build on (a usage error: exit 2)."""


RESET_FORMS = ("ITER:PHASE with ITER an iteration number (1, 2, ...) and PHASE a phase number or name, "
               "for example 3:10 or 3:train; phases: " + ", ".join(f"{p.number} {p.name}" for p in PHASES))


def parse_reset_spec(spec: str) -> tuple[int, int]:
    """`3:10` or `3:train` -> (3, 10); BadResetSpec naming the valid forms otherwise."""
    it_s, sep, ph_s = spec.strip().partition(":")
    by_name = {p.name: p.number for p in PHASES}
    try:
        iteration = int(it_s)
        phase = by_name[ph_s.strip()] if ph_s.strip() in by_name else int(ph_s)
    except ValueError:
        raise BadResetSpec(f"--reset-phase {spec!r} is not valid; use {RESET_FORMS}") from None
    if not sep or iteration < 1 or phase not in BY_NUMBER:
        raise BadResetSpec(f"--reset-phase {spec!r} is not valid; use {RESET_FORMS}")
    return iteration, phase


def _reset_items(layout: RunLayout, spec: str) -> tuple[list[Item], dict[str, int]]:
    iteration, phase = parse_reset_spec(spec)
    items, rollback = [], {}
    for job in JOBS:
        sync = layout.job(job).sync_iter_dir(iteration)
        check_no_links(sync)
        if not sync.exists():
            continue
        later = [n for d in sync.parent.iterdir() if (n := iteration_number(d.name)) is not None and n > iteration]
        if later:
            raise BadResetSpec(
                f"--reset-phase {spec}: job {job} already ran iteration {max(later)}; resetting an older iteration "
                f"would leave later ones decided on its old outputs. Reset the latest iteration, or start a new run.")
        for d in sorted(sync.iterdir()):
            ident = barrier_identity(d.name)
            if ident is None:
                continue  # not a barrier folder baton made: never ours to delete
            num = ident[0]
            if num >= phase:
                items.append(Item(d, f"flag folder of phase {num} of iteration {iteration} (job {job})"))
                rollback[job] = iteration - 1
    if not items:
        raise BadResetSpec(f"--reset-phase {spec}: iteration {iteration} has no flag folders at or after phase "
                             f"{phase} (it never ran there, or was garbage-collected)")
    return items, rollback


def _describe(r: dict, job: str) -> str:
    return f"rank {r['rank']} of job {job} (host {r['host']}, pid {r['pid']})"


def _live(snap: dict) -> list[tuple[str, dict]]:
    """(job, rank row) of every rank that may be running: seen alive or not yet judged."""
    return [(j["job"], r) for j in snap["jobs"] for r in j["ranks"] if r["state"] not in GONE]


def _mark_refused(items: list[Item], snap: dict) -> None:
    """While ranks look alive `apply` removes nothing; say for each item why, naming the live rank
    that may be using it (a training attempt's staging folder of the iteration it is in, a temp
    file with its host and pid) where there is one, so a dry run does not invite an --apply that
    would then refuse."""
    live = _live(snap)
    if not live:
        return
    for it in items:
        users = []
        staging = staging_identity(it.path.name) if it.path.parent.name == ".staging" else None
        writer = temp_writer(it.path.name)
        for job, r in live:
            if staging is not None and r.get("iteration") in (None, staging[0]):
                users.append(f"{_describe(r, job)} is {r['state']} in iteration {r.get('iteration') or '?'}: "
                             f"this may be its training attempt's staging folder")
            elif writer is not None and writer == (r["host"], r["pid"]):
                users.append(f"{_describe(r, job)} is {r['state']} and may still be writing it")
        it.refused = "; ".join(users) or "nodes of the run look alive and recover removes nothing while they run"


def watch_ranks(layout: RunLayout, peer_timeout: float | None = None, *, for_apply: bool = False,
                clock: Clock | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """A status snapshot in which every rank is judged on this machine's clock (docs/design.md
    §5 rule 6): its heartbeat counter moved (alive), its last heartbeat said it ended (exited,
    failed, stopped: at once), or it stood still for peer_timeout (lost). Bounded by peer_timeout;
    for --apply the watch ends as soon as one rank is seen alive (the apply is refused anyway)."""
    reader = StatusReader(layout, peer_timeout, clock)

    def note(snap: dict, elapsed: float) -> None:
        if progress is not None:
            still = [_describe(r, j["job"]) for j in snap["jobs"] for r in j["ranks"] if r["state"] == "not moving"]
            progress(f"recover: watching heartbeats for {elapsed:.0f} of up to {reader.peer_timeout:.0f} s "
                     f"(peer_timeout) before calling a rank dead; not moving yet: {'; '.join(still)}")

    if progress is not None:
        progress(f"recover: watching heartbeat counters on this machine's clock (up to {reader.peer_timeout:.0f} s, "
                 f"the run's peer_timeout; --peer-timeout changes it)")
    alive = (lambda snap: any(r["state"] == "alive" for j in snap["jobs"] for r in j["ranks"])) if for_apply else None
    return reader.watch(reader.peer_timeout, until=alive, progress=note)


def plan(log_path: Path, reset_phase: str | None = None, peer_timeout: float | None = None,
         temp_min_age: float = 60.0, *, for_apply: bool = False, clock: Clock | None = None,
         progress: Callable[[str], None] | None = None) -> tuple[list[Item], dict[str, int], dict]:
    layout = RunLayout(log_path)
    try:
        # A reset that cannot be done (a typo, an iteration that never ran there or that later
        # ones build on) is reported before the watch, which can take up to peer_timeout.
        extra, rollback = _reset_items(layout, reset_phase) if reset_phase else ([], {})
        snap = watch_ranks(layout, peer_timeout, for_apply=for_apply, clock=clock, progress=progress)
        items = _temp_files(layout.root, temp_min_age) + _staging(layout) + extra
        for it in items:  # refuse the whole plan, before anything is removed, if one item is reached by a link
            check_no_links(it.path)
    except LinkInRunFolder as exc:
        raise RecoverRefused(str(exc)) from None
    _mark_refused(items, snap)
    return items, rollback, snap


def live_nodes(snap: dict) -> str:
    """The ranks that may be running, for the message that asks to stop them ('' when none)."""
    return "; ".join(_describe(r, job) + f": {r['state']}" for job, r in _live(snap))


def _check_nothing_runs(layout: RunLayout, snap: dict) -> None:
    """Refuse while a rank may be running: seen alive, not yet judged, or its heartbeat changed
    since the watch ended (a node started meanwhile)."""
    live = live_nodes(snap)
    if live:
        raise RecoverRefused("these nodes look alive (their heartbeat counters moved, or did not stand still for "
                             "peer_timeout), stop them before recovering: " + live)
    run_id = snap.get("run_id")
    for j in snap["jobs"]:
        jl = layout.job(j["job"])
        for r in j["ranks"]:
            rec = read_or_none(jl.heartbeat(r["rank"]), kind=HEARTBEAT_KIND, run_id=run_id)
            now = [rec.data.get("nonce"), rec.data.get("counter"), rec.generation] if rec else None
            if now is not None and now != r.get("beat"):
                raise RecoverRefused(f"{_describe(r, j['job'])} wrote a heartbeat while recover watched; "
                                     f"a node is running: stop it, then run recover again")


def apply(log_path: Path, items: list[Item], rollback: dict[str, int], snap: dict) -> None:
    _check_nothing_runs(RunLayout(log_path), snap)
    layout = RunLayout(log_path)
    try:
        for it in items:
            remove_tree(it.path)  # never through a link (checked again: the plan may be old)
    except LinkInRunFolder as exc:
        raise RecoverRefused(str(exc)) from None
    run = try_read(layout.run_json, kind="run")
    for job, completed in rollback.items():
        jl = layout.job(job)
        prog = read_or_none(jl.progress_json, kind="progress", run_id=run.run_id)
        if prog is not None and int(prog.data["completed_iteration"]) > completed:
            publish_record(jl.progress_json, "progress", {"completed_iteration": completed, "stopped": None},
                           run_id=run.run_id, generation=prog.generation)
