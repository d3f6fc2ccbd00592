"""Barriers: arrival files plus the master's GO (docs/design.md §5 rules 4, 5, 7, 9).

A barrier is named by (job, iteration, phase, attempt) and never reused. Each rank publishes
`rank-R` (ok/error, a small payload, its generation); the master polls the known arrival names,
decides, and creates `GO` exclusively with its decision for everyone; workers poll that one name.
An arrival of generation G counts only while `claim-(G+1)` of that rank does not exist: output of
a superseded process is ignored.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from coordination.claims import superseded
from coordination.node import Node
from coordination.records import RecordError, create_record, publish_record

log = logging.getLogger("baton.barrier")

Decision = Literal["continue", "retry", "abort", "stop"]


@dataclass(frozen=True)
class Arrival:
    rank: int
    generation: int
    ok: bool
    error: str | None
    payload: dict[str, Any]


@dataclass(frozen=True)
class Go:
    decision: Decision
    reason: str
    payload: dict[str, Any] = field(default_factory=dict)
    generation: int = 0
    # rank (as a string) -> {"ok", "error", "generation"} of the arrivals the master released on
    arrivals: dict[str, dict[str, Any]] = field(default_factory=dict)


class Barrier:
    def __init__(self, node: Node, iteration: int, phase: int, name: str, attempt: int = 1):
        self.node = node
        self.iteration = iteration
        self.phase = phase
        self.name = name
        self.attempt = attempt
        self.dir = node.job.barrier_dir(iteration, phase, name, attempt)
        self.go_path = node.job.go(iteration, phase, name, attempt)

    @property
    def label(self) -> str:
        a = f" attempt {self.attempt}" if self.attempt > 1 else ""
        return f"barrier {self.phase} {self.name} of iteration {self.iteration}{a}"

    def _read(self, path, kind: str):
        # Half-written or foreign files are retried; one that stays unusable past
        # coordination.broken_record_timeout raises BrokenRecord naming it.
        return self.node.reader.read(path, kind=kind, run_id=self.node.run_id)

    def read_arrival(self, rank: int) -> Arrival | None:
        rec = self._read(self.node.job.arrival(self.iteration, self.phase, self.name, rank, self.attempt), "arrival")
        if rec is None:
            return None
        d = rec.data
        return Arrival(rank, rec.generation, bool(d.get("ok")), d.get("error"), d.get("payload") or {})

    # -- arriving ----------------------------------------------------------------------------
    def arrive(self, ok: bool = True, error: str | None = None, payload: dict | None = None) -> Arrival:
        self.node.check_fence()  # a superseded process must not publish anything
        data = {"ok": ok, "error": error, "payload": payload or {}}
        publish_record(self.node.job.arrival(self.iteration, self.phase, self.name, self.node.rank, self.attempt),
                       "arrival", data, run_id=self.node.run_id, generation=self.node.generation)
        return Arrival(self.node.rank, self.node.generation, ok, error, payload or {})

    def own_arrival(self) -> Arrival | None:
        """This rank's arrival, if it (or a predecessor generation of it) already made it.

        A predecessor's arrival is adopted: re-published under this generation, so the master,
        which ignores superseded generations, counts the work the predecessor finished."""
        mine = self.read_arrival(self.node.rank)
        if mine is None or mine.generation == self.node.generation:
            return mine
        if mine.generation > self.node.generation:
            self.node.check_fence()  # a newer generation wrote it: we are the stale one
            return None
        if self.read_go() is None:
            return self.arrive(mine.ok, mine.error, mine.payload)
        return Arrival(self.node.rank, self.node.generation, mine.ok, mine.error, mine.payload)

    # -- master side -------------------------------------------------------------------------
    def wait_arrivals(self, ranks: list[int]) -> dict[int, Arrival]:
        """Poll the arrival names of `ranks` until all are present and current."""
        got: dict[int, Arrival] = {}
        pending = list(ranks)

        def probe() -> dict[int, Arrival] | None:
            # Stop at the first missing rank: every rank is needed, so probing the others now
            # would only add metadata load; each arrival is read exactly once when it lands.
            while pending:
                r = pending[0]
                a = self.read_arrival(r)
                if a is None or superseded(self.node.job, r, a.generation):
                    return None
                got[r] = a
                pending.pop(0)
                self.node.say(f"waiting at {self.label} for ranks {pending}" if pending else f"releasing {self.label}",
                              waiting_for=list(pending))
            return got

        # `waiting_for` in the master's heartbeat lets workers waiting for GO watch those ranks too.
        self.node.say(f"waiting at {self.label} for ranks {pending}", beat=True, waiting_for=list(pending))
        try:
            return self.node.wait_for(probe, what=self.label, peers=lambda: list(pending), dirs=[self.dir])
        finally:
            self.node.say(f"released {self.label}", waiting_for=[])

    def release(self, decision: Decision, reason: str = "", payload: dict | None = None,
                arrivals: dict[int, Arrival] | None = None) -> Go:
        """Create GO once. If it already exists (a previous master generation released it),
        that decision stands and is returned."""
        self.node.check_fence()
        data = {"decision": decision, "reason": reason, "payload": payload or {},
                "arrivals": {str(r): {"ok": a.ok, "error": a.error, "generation": a.generation}
                             for r, a in (arrivals or {}).items()}}
        create_record(self.go_path, "go", data, run_id=self.node.run_id, generation=self.node.generation)
        go = self.read_go()
        if go is None:
            raise RecordError(f"{self.go_path} was just created but cannot be read back")
        return go

    # -- worker side -------------------------------------------------------------------------
    def read_go(self) -> Go | None:
        rec = self._read(self.go_path, "go")
        if rec is None:
            return None
        d = rec.data
        return Go(d["decision"], d.get("reason", ""), d.get("payload") or {}, rec.generation, d.get("arrivals") or {})

    def wait_go(self) -> Go:
        self.node.say(f"waiting at {self.label} for the master's GO", beat=True)
        return self.node.wait_for(self.read_go, what=f"the master's GO at {self.label}", peers=self._go_peers,
                                  dirs=[self.dir])

    def _go_peers(self) -> list[int]:
        """The master, and the ranks its last heartbeat says it is waiting for: every survivor
        then names a lost rank, not only the master."""
        rec = self.node.liveness.last_record(0)
        others = rec.data.get("waiting_for") or [] if rec else []
        return [0] + [int(r) for r in others if int(r) != self.node.rank]
