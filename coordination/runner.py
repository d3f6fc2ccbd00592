"""The phase runner: one loop executes a table of phases for one rank, so adding
a phase is adding a row to the table, not another copy of the wait logic (docs/design.md §6).

Knows nothing of RL. Each row names who acts, the action, whether it ends in a barrier and how
the master decides there. Progress is read back from this rank's own arrival files, so a
restarted rank resumes at the first phase it has not arrived at, and phases it finished are not
run again (docs/design.md §5 rule 8). A failed action is a decision, not a hang (rule 9): the failing
rank reports the error at the next barrier and the master's GO says retry, abort or go on.
An abort ends the processes that took part in it, not the next ones: a rank restarted since
(a higher generation than its arrival in that GO) tries the phase again under a new attempt
number (docs/design.md §5 rule 9), so fixing an input and restarting is enough.
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable

from coordination import diagnose, exhaustion, log as blog, timeline
from coordination.barrier import Arrival, Barrier, Decision, Go
from coordination.claims import Fenced
from coordination.layout import check_no_links, iteration_number
from coordination.node import Node, PeerLost
from coordination.phases import PhaseSpec
from coordination.records import fence_check, publish_record, read_or_none, remove_tree

log = logging.getLogger("baton.runner")


class PhaseFailed(RuntimeError):
    """The master's GO said abort; the message carries its reason."""


@dataclass
class Verdict:
    decision: Decision
    reason: str = ""
    payload: dict = field(default_factory=dict)


@dataclass
class Step:
    """What an action sees: where it is and what the master decided so far this iteration."""

    node: Node
    iteration: int
    spec: PhaseSpec
    attempt: int
    gos: dict[int, Go]
    retry: Go | None = None  # the GO that asked for this attempt

    def go_payload(self, phase: int) -> dict:
        go = self.gos.get(phase)
        return go.payload if go else {}


Action = Callable[[Step], "dict | None"]
Decide = Callable[[Step, "dict[int, Arrival]"], Verdict]


@dataclass
class Phase:
    spec: PhaseSpec
    action: Action | None = None          # run by spec.who before arriving
    decide: Decide | None = None          # barrier only: the master's decision once all arrived
    enabled: Callable[[Step], bool] | None = None
    max_attempts: int = 1
    attempts_key: str = "the phase's max_attempts"  # the setting that raises max_attempts, for messages


def default_decide(step: Step, arrivals: dict[int, Arrival]) -> Verdict:
    failed = {r: a for r, a in arrivals.items() if not a.ok}
    if not failed:
        return Verdict("continue")
    return Verdict("abort", failure_summary(step, failed))


def failure_summary(step: Step, failed: dict[int, Arrival]) -> str:
    """The first line of each failing rank's error, then the lines of its log that say why (the
    exception, gloo/NCCL's words), then what to do when diagnose's table knows the cause. Every
    node prints this (the GO carries it), so nobody has to open another node's log to see it."""
    firsts, details = [], []
    job = step.node.job
    for r, a in sorted(failed.items()):
        lines = (a.error or "failed").splitlines() or ["failed"]
        firsts.append(f"rank {r}: {lines[0]} (details: {job.log_file(r, 'driver')})")
        more = diagnose.relevant_lines("\n".join(lines[1:]))
        if more:
            details.append(f"rank {r}:\n" + "\n".join(f"    {m}" for m in more))
    text = f"iteration {step.iteration} failed at phase {step.spec.number} {step.spec.name}: " + "; ".join(firsts)
    if details:
        text += "\n  " + "\n  ".join(details)
    todo = diagnose.advice("\n".join(a.error or "" for a in failed.values()), str(step.node.layout.root))
    return text + (f"\n  what to do: {todo}" if todo else "")


@dataclass
class Outcome:
    iterations_run: int
    stopped: str


class PhaseRunner:
    def __init__(self, node: Node, phases: list[Phase], *, max_iterations: int,
                 stop_requested: Callable[[], str | None] = lambda: None, gc_keep_iterations: int = 3,
                 finished_reason: str | None = None,
                 on_iteration_end: Callable[[int, Go, float], None] | None = None):
        if not phases:
            raise ValueError("a job needs at least one phase")
        self.node = node
        self.phases = phases
        self.max_iterations = max_iterations
        self.stop_requested = stop_requested
        self.gc_keep = gc_keep_iterations
        self.finished_reason = finished_reason or f"max_iterations ({max_iterations}) reached"
        self.on_iteration_end = on_iteration_end  # (iteration, final GO, seconds this process spent on it)
        if not any(p.spec.barrier for p in phases):
            raise ValueError("a job's phase table must contain at least one barrier")
        self.final = -1  # the last barrier enabled in the current iteration
        self._error: str | None = None

    # -- progress ----------------------------------------------------------------------------
    def progress(self) -> dict:
        rec = read_or_none(self.node.job.progress_json, kind="progress", run_id=self.node.run_id)
        return rec.data if rec else {"completed_iteration": 0, "stopped": None}

    def _event(self, it: int, spec: PhaseSpec, attempt: int, event: str, **extra) -> None:
        timeline.append(self.node.job.timeline(self.node.rank), dict(
            job=self.node.job.name, rank=self.node.rank, generation=self.node.generation, iteration=it,
            phase=spec.number, name=spec.name, attempt=attempt, event=event, wall=self.node.clock.wall(), **extra))

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Outcome:
        prog = self.progress()
        if prog.get("stopped"):
            return Outcome(0, f"the run already stopped after iteration {prog['completed_iteration']}: "
                              f"{prog['stopped']}")
        it = int(prog.get("completed_iteration", 0)) + 1
        ran = 0
        while True:
            if it > self.max_iterations:
                return Outcome(ran, self.finished_reason)
            started = self.node.clock.monotonic()
            go = self.run_iteration(it)
            ran += 1
            if self.on_iteration_end is not None and go.decision in ("continue", "stop"):
                self.on_iteration_end(it, go, self.node.clock.monotonic() - started)
            if go.decision == "stop":
                return Outcome(ran, go.reason)
            it += 1

    def run_iteration(self, it: int) -> Go:
        self._error = None
        gos: dict[int, Go] = {}
        # Which phases run is decided from the iteration alone (eval iterations, the final
        # evaluation), the same on every rank; the last barrier among them ends the iteration.
        active = [p for p in self.phases
                  if p.enabled is None or p.enabled(Step(self.node, it, p.spec, 1, gos))]
        barriers = [p.spec.number for p in active if p.spec.barrier]
        if not barriers:
            raise ValueError(f"iteration {it} has no barrier among its phases; the phase table is wrong")
        self.final = barriers[-1]
        for phase in active:
            go = self._run_phase(phase, it, gos)
            if go is not None:
                gos[phase.spec.number] = go
        return gos[self.final]

    def _acts(self, spec: PhaseSpec) -> bool:
        return spec.who == "all" or self.node.is_master

    def _run_phase(self, phase: Phase, it: int, gos: dict[int, Go]) -> Go | None:
        spec, node = phase.spec, self.node
        attempt, retry = 1, None
        # Published at once (the heartbeat writes a new phase in this thread), for every phase this
        # rank passes, acting or waiting: a rank lost now is reported at this phase, not an older one.
        node.say(f"phase {spec.number} {spec.name}", iteration=it, phase=spec.number, phase_name=spec.name)
        while True:
            blog.check()  # a node whose log file was lost to a full disk stops here
            step = Step(node, it, spec, attempt, gos, retry)
            barrier = Barrier(node, it, spec.number, spec.name, attempt)
            go = barrier.read_go() if spec.barrier else None
            decided_before = go is not None  # by processes that ran before this one got here
            if go is None:
                self._arrive(phase, step, barrier)
                if not spec.barrier:
                    return None
                go = self._release(phase, step, barrier) if node.is_master else self._wait_go(step, barrier)
            if go.decision == "retry":
                log.warning("%s: the master asked for attempt %d: %s", barrier.label, attempt + 1, go.reason)
                attempt, retry = attempt + 1, go
                self._error = None
                continue
            if go.decision == "abort":
                if decided_before and self._restarted_since(go):
                    # The abort ended the processes that took part in it; a node restarted since
                    # (typically with its input fixed) tries again under a new attempt number.
                    log.warning("%s: the previous attempt aborted (%s); this process (generation %d) was started "
                                "after that decision, so it tries again as attempt %d", barrier.label, go.reason,
                                node.generation, attempt + 1)
                    attempt, retry = attempt + 1, go
                    self._error = None
                    continue
                raise PhaseFailed(go.reason)
            return go

    def _restarted_since(self, go: Go) -> bool:
        """True when this rank's process is newer than the one whose arrival the GO was decided on."""
        mine = go.arrivals.get(str(self.node.rank)) or {}
        return mine.get("generation") is not None and self.node.generation > int(mine["generation"])

    def _arrive(self, phase: Phase, step: Step, barrier: Barrier) -> None:
        spec, node = phase.spec, self.node
        if not self._acts(spec):
            return
        if barrier.own_arrival() is not None:
            return  # done before a restart (by this process or its predecessor generation)
        ok, error, payload = True, None, {}
        if self._error is not None:
            ok, error = False, self._error  # an earlier phase of this iteration failed here
        elif phase.action is not None:
            node.say(f"phase {spec.number} {spec.name}", beat=True)
            self._event(step.iteration, spec, step.attempt, "start")
            try:
                self._hold(spec)
                payload = phase.action(step) or {}
            except (Fenced, PeerLost):
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the master, which decides
                node.check_fence()  # a fenced process's failure is not news for anyone
                short = exhaustion.of(exc, node.layout.root)
                if short is not None:
                    # Not a failure the master could retry (the next write fails the same way): this
                    # node stops with one line (exit 8), its traceback in its log, and resumes here
                    # once restarted; its peers wait for it meanwhile, as for any node that exited.
                    raise short from exc
                # The console gets the error once, here and in the GO's summary (which names this
                # log); the traceback goes to the log alone.
                log.error("phase %d %s failed: %s: %s", spec.number, spec.name, type(exc).__name__, exc)
                log.error("phase %d %s failed:\n%s", spec.number, spec.name, traceback.format_exc(),
                          extra=blog.FILE_ONLY)
                ok, error = False, f"{type(exc).__name__}: {exc}"[:2000]
                self._error = f"phase {spec.number} {spec.name}: {error}"
            self._event(step.iteration, spec, step.attempt, "end", ok=ok)
        if spec.barrier or ok:
            barrier.arrive(ok, error, payload)

    def _hold(self, spec: PhaseSpec) -> None:
        """Chaos drills: BATON_HOLD_PHASE=PHASE:SECONDS makes this process wait that long at the
        start of that phase's action, so an operator (or a test) can kill a node inside it and
        watch the run recover. Unset in normal runs."""
        hold = os.environ.get("BATON_HOLD_PHASE", "")
        if not hold:
            return
        try:
            phase, seconds = hold.split(":")
            if int(phase) == spec.number:
                log.warning("BATON_HOLD_PHASE: holding phase %d for %s s", spec.number, seconds)
                self.node.clock.sleep(float(seconds))
        except ValueError:
            raise ValueError(f"BATON_HOLD_PHASE={hold!r} must be PHASE:SECONDS, e.g. 3:20") from None

    def _release(self, phase: Phase, step: Step, barrier: Barrier) -> Go:
        node = self.node
        self._event(step.iteration, step.spec, step.attempt, "wait-start")
        arrivals = barrier.wait_arrivals(list(range(node.num_nodes)))
        verdict = (phase.decide or default_decide)(step, arrivals)
        if verdict.decision == "retry" and step.attempt >= phase.max_attempts:
            # The one place the attempt cap is applied. The retry's payload (for phase 10 the next
            # attempt's rendezvous) rides along: nodes restarted after this abort try once more
            # under attempt + 1 (_run_phase) and need it. For a known cause the reason already
            # says what to do; otherwise more attempts may help a transient failure.
            more = "" if "\n  what to do: " in verdict.reason else f"; raise {phase.attempts_key} to retry more"
            verdict = Verdict("abort", f"{verdict.reason}\n  (attempt {step.attempt} of {phase.max_attempts}: "
                                       f"no attempts left{more})", verdict.payload)
        if step.spec.number == self.final and verdict.decision == "continue":
            reason = self.stop_requested()
            if reason is None and step.iteration >= self.max_iterations:
                reason = self.finished_reason
            if reason is not None:
                verdict = Verdict("stop", reason, verdict.payload)
        go = barrier.release(verdict.decision, verdict.reason, verdict.payload, arrivals)
        self._event(step.iteration, step.spec, step.attempt, "wait-end", decision=go.decision)
        if step.spec.number == self.final and go.decision in ("continue", "stop"):
            # Written after GO: a master that dies in between resumes this iteration, finds every
            # GO in place and passes through; written before, it would skip a GO nobody created.
            publish_record(node.job.progress_json, "progress",
                           {"completed_iteration": step.iteration,
                            "stopped": go.reason if go.decision == "stop" else None},
                           run_id=node.run_id, generation=node.generation)
            self.collect_garbage(step.iteration)
        return go

    def _wait_go(self, step: Step, barrier: Barrier) -> Go:
        self._event(step.iteration, step.spec, step.attempt, "wait-start")
        go = barrier.wait_go()
        self._event(step.iteration, step.spec, step.attempt, "wait-end", decision=go.decision)
        return go

    def collect_garbage(self, iteration: int) -> list[int]:
        """Remove barrier folders of iterations older than the keep window (master only)."""
        removed = []
        fence_check()  # removing is writing: a superseded master leaves the folders alone
        sync = self.node.job.sync_dir
        check_no_links(sync)  # never list (and then delete) the entries of a linked folder
        if not sync.exists():
            return removed
        for d in sync.iterdir():
            n = iteration_number(d.name)
            if n is not None and n <= iteration - self.gc_keep:
                remove_tree(d, ignore_errors=True)
                removed.append(n)
        return sorted(removed)
