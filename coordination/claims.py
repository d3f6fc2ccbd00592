"""Rank claims with generations: who may act as rank R, and fencing of superseded holders
(docs/design.md §5 rule 7).

Two mechanisms, each for what it is good at:

- `filelock.SoftFileLease` on `nodes/rank-R/lease` decides *who may take the rank now*. It is
  built for NFS/HPC: it proves a same-host holder dead from its pid and process start token
  (so a restarted rank on the same host takes over at once, and a recycled pid does not fool
  it), lets a contender take a claim only after it has seen no refresh for `lease_duration` on
  its *own* monotonic clock, and tells a superseded holder through `on_compromise`. Writing
  that again would be writing filelock again, with fewer years of bug reports behind it.
- `claim-G` files (O_EXCL, never deleted while the run lives) give the *generation* that
  fences everything a rank publishes. filelock cannot do this part: its lease token "names a
  claim; it does not fence one" (its own docs), and a paused holder that wakes up keeps running
  until it notices. Readers therefore compare the generation stamped on every record with the
  rank's latest claim: output of generation G is ignored once `claim-(G+1)` exists.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

from filelock import SoftFileLease, Timeout

from coordination import fsops
from coordination.clock import Clock
from coordination.config import CoordinationConfig
from coordination.heartbeat import LivenessTracker
from coordination.layout import JobLayout
from coordination.records import Fenced, FenceGuard, RecordError, create_record, ensure_dir, try_read  # noqa: F401 - Fenced is caught as claims.Fenced

log = logging.getLogger("baton.claims")

KIND = "claim"


class ClaimRefused(RuntimeError):
    """Another live process holds this rank."""


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass
class Holder:
    generation: int
    host: str
    pid: int

    def __str__(self) -> str:
        return f"host {self.host} pid {self.pid} (generation {self.generation})"


def latest_holder(job: JobLayout, rank: int) -> Holder | None:
    """The holder named by the highest claim file of `rank` (a directory listing; call rarely)."""
    for gen in reversed(job.claim_generations(rank)):
        try:
            rec = try_read(job.claim(rank, gen), kind=KIND)
        except RecordError:
            rec = None
        if rec is not None:
            return Holder(gen, rec.data.get("host", "?"), int(rec.data.get("pid", -1)))
    return None


def superseded(job: JobLayout, rank: int, generation: int) -> bool:
    """True when a newer claim than `generation` exists (one stat of a known name)."""
    return fsops.exists(job.claim(rank, generation + 1))


class RankClaim:
    """Take rank `rank` of `job` for this process. `acquire()` returns the new generation."""

    def __init__(self, job: JobLayout, rank: int, *, run_id: str, cfg: CoordinationConfig,
                 clock: Clock | None = None, command: str = ""):
        self.job = job
        self.command = command
        self.rank = rank
        self.run_id = run_id
        self.cfg = cfg
        self.clock = clock or Clock()
        self.generation = 0
        self._compromised = threading.Event()
        self._lease: SoftFileLease | None = None

    # -- taking the rank ---------------------------------------------------------------------
    def acquire(self) -> int:
        ensure_dir(self.job.node_dir(self.rank))
        lease = SoftFileLease(
            self.job.lease(self.rank), lease_duration=self.cfg.peer_timeout,
            heartbeat_interval=self.cfg.heartbeat_interval, on_compromise=self._on_compromise,
            thread_local=False)
        try:
            lease.acquire(timeout=0)
        except Timeout:
            self._wait_for_stale_holder(lease)
        self._lease = lease
        gen = max(self.job.claim_generations(self.rank), default=0) + 1
        data = {"host": socket.gethostname(), "pid": os.getpid(), "boot_id": boot_id(),
                "lease_token": lease.token, "command": self.command}
        while not create_record(self.job.claim(self.rank, gen), KIND, data, run_id=self.run_id, generation=gen):
            gen += 1  # only a holder that lost its lease races us here; the newest claim wins
        self.generation = gen
        if gen > 1:
            log.info("took over rank %d of job %s as generation %d", self.rank, self.job.name, gen)
        return gen

    def _wait_for_stale_holder(self, lease: SoftFileLease) -> None:
        """The lease is held. Refuse at once if the holder's heartbeat is moving; otherwise wait,
        bounded, for the lease to expire on our clock."""
        holder = latest_holder(self.job, self.rank)
        who = str(holder) if holder else "an unknown process"
        tracker = LivenessTracker(self.cfg.peer_timeout, self.clock)
        watch = 2 * self.cfg.heartbeat_interval + 1.0
        start = self.clock.monotonic()
        hb = self.job.heartbeat(self.rank)
        view = tracker.read(hb, self.rank, run_id=self.run_id)
        while self.clock.monotonic() - start < watch:
            self.clock.sleep(min(1.0, self.cfg.heartbeat_interval / 2))
            view = tracker.read(hb, self.rank, run_id=self.run_id)
            if view.last_change > view.first_seen:
                raise ClaimRefused(
                    f"rank {self.rank} of job {self.job.name} is already held by a live process: {who}, "
                    f"heartbeat moving ({view.describe()}). Stop that process first, or start this one "
                    f"with another rank.")
        log.warning("rank %d is held by %s whose heartbeat has not moved for %.0f s; waiting up to %.0f s "
                    "for its lease to expire (peer_timeout)", self.rank, who, watch, self.cfg.peer_timeout)
        try:
            lease.acquire(timeout=self.cfg.peer_timeout + 2 * self.cfg.heartbeat_interval)
        except Timeout:
            raise ClaimRefused(
                f"rank {self.rank} of job {self.job.name} is still held by {who}: its lease kept being "
                f"refreshed for {self.cfg.peer_timeout:.0f} s although its heartbeat did not move. "
                f"Check that process on host {holder.host if holder else '?'} and stop it.") from None

    # -- fencing ---------------------------------------------------------------------------
    def _on_compromise(self, compromise) -> None:
        log.error("rank %d generation %d lost its lease (%s): another process took this rank over",
                  self.rank, self.generation, getattr(compromise, "reason", compromise))
        self._compromised.set()

    def is_fenced(self, probe: bool = True) -> bool:
        """True once this process must stop: lease compromised or (with `probe`, one stat) a newer
        claim exists. The lease flag is free to read; the stat is for callers that run rarely."""
        if self._compromised.is_set():
            return True
        if probe and self.generation and superseded(self.job, self.rank, self.generation):
            self._compromised.set()
            return True
        return False

    def fence_guard(self) -> FenceGuard:
        """The process-wide guard every writer asks before publishing (records.install_fence):
        this claim's lease flag, then one stat of claim-(G+1)."""
        return FenceGuard(self.job.claim(self.rank, self.generation + 1), flag=self._compromised.is_set,
                          on_fenced=self._compromised.set, explain=self._fenced_message)

    def _fenced_message(self) -> str:
        newer = latest_holder(self.job, self.rank)
        by = f" by {newer}" if newer and newer.generation > self.generation else ""
        return (f"rank {self.rank} generation {self.generation} was taken over{by}; this process "
                f"stops without writing anything further")

    def check(self, probe: bool = True) -> None:
        """Raise Fenced when this process has been superseded."""
        if self.is_fenced(probe):
            raise Fenced(self._fenced_message())

    def release(self) -> None:
        """Give up the lease on a clean exit (claim files stay: they are the generation history)."""
        if self._lease is not None:
            try:
                self._lease.release()
            except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the lease lingers
                log.warning("could not release lease %s: %s", self.job.lease(self.rank), exc)
            self._lease = None
