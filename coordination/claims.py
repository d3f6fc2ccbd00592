"""Rank claims with generations: who may act as rank R, and fencing of superseded holders
(docs/design.md §5 rule 7).

A process takes rank R by creating `nodes/rank-R/claim-G` with O_CREAT|O_EXCL, G one above the
newest claim. Claim files are never deleted while the run lives, so a generation is never reused
and the O_EXCL create is the only decision: of any number of contenders for G, exactly one
creates the file; every other one gets EEXIST and judges the new holder from scratch.

Before creating claim-(G+1) a contender must show the holder of G dead:
- same machine (hostname, boot id and pid namespace) and the holder's pid gone, or running with
  another start time (/proc/<pid>/stat, so a recycled pid does not look alive): at once;
- the holder said goodbye (its last heartbeat of generation G says exited/failed/stopped): at once;
- otherwise only after the holder's heartbeat (nonce, counter) has not changed for
  `peer_timeout` on this process's monotonic clock. A heartbeat that moves meanwhile means a
  live holder: ClaimRefused naming its host and pid.
The superseded holder learns it is fenced when it sees claim-(G+1), or a heartbeat of a newer
generation (a read of content, which NFS revalidates on open even where it caches a negative
lookup of the new claim's name). Readers compare the generation stamped on every record with the
rank's latest claim: output of generation G is ignored once claim-(G+1) exists.

Why not filelock: its `SoftFileLease` (4.2.11 and 4.2.12) breaks a stale lease only by swapping
the marker with `renameat2(RENAME_EXCHANGE)`, so that the lock path is never empty beside a
possibly live holder. sshfs and the Linux NFS client reject rename flags with EINVAL; filelock
then leaves the marker in place by design and its `acquire` waits until its timeout, so a
restarted rank was refused forever on network filesystems. It also judges staleness by the
marker's mtime, which is the writer's (or server's) clock. Generations do not need an exchange:
the old holder's name is never taken away from it, a new name fences it. Everything here uses
only O_EXCL create, reads of content, stat and readdir, which NFSv3/v4, Lustre, GPFS and FUSE
filesystems implement with these semantics.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from coordination import fsops
from coordination.clock import Clock
from coordination.config import CoordinationConfig
from coordination.heartbeat import KIND as HEARTBEAT_KIND, LivenessTracker
from coordination.layout import JobLayout
from coordination.records import Fenced, FenceGuard, create_record, ensure_dir, read_or_none  # noqa: F401 - Fenced is caught as claims.Fenced

log = logging.getLogger("baton.claims")

KIND = "claim"
GOODBYE_STATES = ("exited", "failed", "stopped")  # final heartbeat states: the holder wrote its last file


class ClaimRefused(RuntimeError):
    """Another live process holds this rank."""


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """Two containers with one hostname on one kernel share a boot id but not a pid namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22); None if there is
    no such live process (gone, or a zombie that only waits to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name in parentheses may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def machine() -> dict:
    """What makes two claims 'on the same machine' with comparable pids."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_namespace()}


@dataclass
class Holder:
    generation: int
    host: str
    pid: int
    data: dict | None = None  # the claim record's data (None when it could not be read)

    def __str__(self) -> str:
        return f"host {self.host} pid {self.pid} (generation {self.generation})"

    def same_machine(self) -> bool:
        if not self.data:
            return False
        here = machine()
        return all(self.data.get(k) == v and v for k, v in here.items())

    def process_gone(self) -> bool:
        """Only meaningful on the same machine: the claiming process no longer runs."""
        start = process_start(self.pid)
        return start is None or (self.data or {}).get("pid_start") not in (None, start)


def read_holder(job: JobLayout, rank: int, gen: int) -> Holder:
    """The holder named by claim-`gen` (host '?' when the file is torn or not written yet)."""
    rec = read_or_none(job.claim(rank, gen), kind=KIND)
    if rec is None:
        return Holder(gen, "?", -1)
    return Holder(gen, rec.data.get("host", "?"), int(rec.data.get("pid", -1)), rec.data)


def newest_generation(job: JobLayout, rank: int, at_least: int = 0) -> int:
    """The highest claim generation of `rank`. A directory listing can lag behind new files on
    network filesystems (sshfs lists a new file ~20 s late), so names above it are probed one by
    one; a probe that still misses one is caught by O_EXCL when the caller tries that name."""
    gen = max(job.claim_generations(rank), default=0)
    gen = max(gen, at_least)
    while fsops.exists(job.claim(rank, gen + 1)):
        gen += 1
    return gen


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
        self._fenced = False
        self._next_refresh = 0.0

    # -- taking the rank ---------------------------------------------------------------------
    def acquire(self) -> int:
        ensure_dir(self.job.node_dir(self.rank))
        data = dict(machine(), pid=os.getpid(), pid_start=process_start(os.getpid()), command=self.command)
        gen = newest_generation(self.job, self.rank)
        while True:
            if gen:
                self._wait_until_dead(read_holder(self.job, self.rank, gen))
            if create_record(self.job.claim(self.rank, gen + 1), KIND, data, run_id=self.run_id, generation=gen + 1):
                break
            # Another contender created claim-(gen+1) first: it is the holder now, judged afresh
            # (refused at once if it is alive, which is what makes one winner of every race).
            log.info("rank %d: another process took generation %d first; checking it", self.rank, gen + 1)
            gen = newest_generation(self.job, self.rank, gen + 1)
        self.generation = gen + 1
        if self.generation > 1:
            log.info("took over rank %d of job %s as generation %d", self.rank, self.job.name, self.generation)
        return self.generation

    def _wait_until_dead(self, holder: Holder) -> None:
        """Return once `holder` is shown dead; raise ClaimRefused as soon as it shows life.
        Bounded: at most `peer_timeout` plus one poll."""
        if holder.same_machine() and holder.process_gone():
            log.info("rank %d: its holder %s is gone from this machine; taking over at once", self.rank, holder)
            return
        tracker = LivenessTracker(self.cfg.peer_timeout, self.clock)
        hb = self.job.heartbeat(self.rank)
        poll = min(1.0, self.cfg.heartbeat_interval / 2)
        warned = False
        while True:
            view = tracker.read(hb, self.rank, run_id=self.run_id, min_generation=holder.generation)
            if view.last_change > view.first_seen:
                who = holder if holder.host != "?" else f"host {view.host} pid {view.pid}"
                raise ClaimRefused(
                    f"rank {self.rank} of job {self.job.name} is already held by a live process: {who}, "
                    f"heartbeat moving ({view.describe()}). Stop that process first, or start this one "
                    f"with another rank.")
            rec = view.record
            if rec is not None and rec.generation == holder.generation and rec.data.get("state") in GOODBYE_STATES:
                log.info("rank %d: its holder %s said goodbye (%s); taking over", self.rank, holder,
                         rec.data.get("state"))
                return
            if view.lost:
                log.warning("rank %d: its holder %s showed no heartbeat change for %.0f s (peer_timeout); "
                            "taking over", self.rank, holder, view.silent_for)
                return
            if not warned and view.silent_for >= 2 * self.cfg.heartbeat_interval:
                warned = True
                log.warning("rank %d is held by %s whose heartbeat has not moved for %.0f s; taking over if it "
                            "stays still for %.0f s (coordination.peer_timeout)", self.rank, holder,
                            view.silent_for, self.cfg.peer_timeout)
            self.clock.sleep(poll)

    # -- fencing ---------------------------------------------------------------------------
    def _newer_heartbeat(self) -> bool:
        rec = read_or_none(self.job.heartbeat(self.rank), kind=HEARTBEAT_KIND, run_id=self.run_id)
        return rec is not None and rec.generation > self.generation

    def is_fenced(self, probe: bool = True) -> bool:
        """True once this process must stop because a newer generation exists. Without `probe`
        only the remembered answer (free); with it one stat of claim-(G+1) and one read of the
        heartbeat. The heartbeat thread probes before every beat, so the remembered answer is at
        most one heartbeat interval old."""
        if self._fenced:
            return True
        if probe and self.generation:
            now = self.clock.monotonic()
            if now >= self._next_refresh:  # let NFS clients drop a cached "claim-(G+1) does not exist"
                fsops.refresh_dir(self.job.node_dir(self.rank))
                self._next_refresh = now + self.cfg.dir_refresh_interval
            if superseded(self.job, self.rank, self.generation) or self._newer_heartbeat():
                log.error("rank %d generation %d was superseded: another process took this rank over",
                          self.rank, self.generation)
                self._fenced = True
        return self._fenced

    def fence_guard(self) -> FenceGuard:
        """The process-wide guard every writer asks before publishing (records.install_fence):
        what this claim already knows, then one stat of claim-(G+1)."""
        return FenceGuard(self.job.claim(self.rank, self.generation + 1), flag=lambda: self._fenced,
                          on_fenced=self._mark_fenced, explain=self._fenced_message)

    def _mark_fenced(self) -> None:
        self._fenced = True

    def _fenced_message(self) -> str:
        newer = read_holder(self.job, self.rank, self.generation + 1)
        by = f" by {newer}" if newer.host != "?" else ""
        return (f"rank {self.rank} generation {self.generation} was taken over{by}; this process "
                f"stops without writing anything further")

    def check(self, probe: bool = True) -> None:
        """Raise Fenced when this process has been superseded."""
        if self.is_fenced(probe):
            raise Fenced(self._fenced_message())

    def release(self) -> None:
        """Nothing to remove on a clean exit: claim files stay (they are the generation history),
        and the final heartbeat (state exited/failed/stopped) is the goodbye that lets a successor
        take over at once."""
