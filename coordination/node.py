"""One rank's identity in a job, and the bounded wait every coordination step uses.

`Node.join(...)` takes the rank's claim and starts its heartbeat; `Node.wait_for(...)` polls known
file names with backoff while judging the peers it waits for (docs/design.md §5 rules 5, 6 and 9):
a lost peer is named with its host, last phase and the command that restarts it; the wait goes
on for `rejoin_timeout` so the peer can come back; after that it raises `PeerLost`.
"""
from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from coordination import fsops, log as blog
from coordination.claims import KIND as CLAIM_KIND, RankClaim
from coordination.clock import Backoff, Clock
from coordination.config import CoordinationConfig
from coordination.heartbeat import HeartbeatWriter, LivenessTracker, PeerView
from coordination.layout import JobLayout, RunLayout
from coordination.records import FenceGuard, PatientReader, install_fence, read_or_none
from coordination.stall import MainThreadWatch

log = logging.getLogger("baton.node")

T = TypeVar("T")


class PeerLost(RuntimeError):
    """A peer stayed lost past rejoin_timeout."""


@dataclass
class Node:
    layout: RunLayout
    job: JobLayout
    run_id: str
    rank: int
    num_nodes: int
    cfg: CoordinationConfig
    clock: Clock = field(default_factory=Clock)
    generation: int = 0
    claim: RankClaim | None = None
    heartbeat: HeartbeatWriter | None = None
    fence: FenceGuard | None = None

    def __post_init__(self) -> None:
        self.liveness = LivenessTracker(self.cfg.peer_timeout, self.clock)
        self.reader = PatientReader(self.cfg.broken_record_timeout, self.clock.monotonic)
        self._lost_since: dict[int, float] = {}
        self._hints: dict[int, str] = {}
        # Every wait: what it waited for, how long, and the metadata operations made meanwhile.
        self.waits: list[dict] = []
        self._watcher: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self._announced: set[int] = set()  # peers named lost or exited and not back since
        self._judge_lock = threading.Lock()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def role(self) -> str:
        return "master" if self.is_master else f"worker {self.rank}"

    @classmethod
    def join(cls, layout: RunLayout, job: str, rank: int, num_nodes: int, *, run_id: str,
             cfg: CoordinationConfig, command: str = "", clock: Clock | None = None) -> "Node":
        """Claim `rank` (refusing a live duplicate) and start heartbeating."""
        clock = clock or Clock()
        jl = layout.job(job)
        claim = RankClaim(jl, rank, run_id=run_id, cfg=cfg, clock=clock, command=command)
        gen = claim.acquire()
        node = cls(layout, jl, run_id, rank, num_nodes, cfg, clock, gen, claim)
        # From here on every publish, create and append of this process (and of the children it
        # starts) first checks that no newer generation took the rank (docs/design.md §5 rule 7).
        node.fence = claim.fence_guard()
        install_fence(node.fence)
        node.heartbeat = HeartbeatWriter(
            jl.heartbeat(rank), run_id=run_id, generation=gen, job=job, rank=rank,
            interval=cfg.heartbeat_interval, clock=clock,
            fenced=lambda: claim.is_fenced(probe=False),  # the publish itself stats the claim
            watch=MainThreadWatch(cfg.stuck_report_after, clock.monotonic).check).start()
        node.start_watching()
        return node

    def close(self, final_state: str = "exited", message: str | None = None) -> None:
        self.stop_watching()
        if self.heartbeat is not None:
            self.heartbeat.stop(final_state, message)
        if self.claim is not None and not self.claim.is_fenced(probe=False):
            self.claim.release()  # a fenced process touches nothing the generation that took over owns
        if self.fence is not None:
            install_fence(None)

    # -- watching the peers while this node is busy -----------------------------------------
    def start_watching(self) -> None:
        """Read the peers' heartbeats every heartbeat_interval/2 from a daemon thread, so the
        silence of a peer is timed from its last change even while this node is busy in an
        action (a wait that starts later judges from that), and a lost peer is named within
        peer_timeout + heartbeat_interval of its last beat (docs/design.md §5 rule 6).

        The master watches every rank, a worker only the master: that is who each must judge to
        decide, and it keeps the reads linear in the number of nodes (a worker's waits still judge
        the ranks the master waits for)."""
        if self._watcher is None and self.num_nodes > 1:
            self._watcher = threading.Thread(target=self._watch, name="baton-peer-watch", daemon=True)
            self._watcher.start()

    def stop_watching(self) -> None:
        self._watch_stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=self.cfg.heartbeat_interval + 5)
        self._watcher = None

    def _watch(self) -> None:
        interval = self.cfg.heartbeat_interval / 2
        while not self._watch_stop.wait(interval):
            try:
                doing = self.heartbeat.state.get("message") if self.heartbeat else "?"
                for r in (range(1, self.num_nodes) if self.is_master else (0,)):
                    # A peer that said goodbye is no news here: the waits that need it say so.
                    self._judge(self.peer_view(r), f"this node was busy ({doing})", exits=False)
            except Exception as exc:  # noqa: BLE001 - a hiccup must not end the watch; waits still judge
                log.warning("could not read the peers' heartbeats: %s (retrying in %.1f s)", exc, interval)

    def _judge(self, view: PeerView, doing: str, exits: bool = True) -> bool:
        """True when the peer is lost (or, with `exits`, exited). Names it once per loss, from
        whichever thread sees it first (the watcher or a wait), and says once when it is back."""
        r = view.rank
        down = exits if view.exited else view.lost
        with self._judge_lock:
            if down and r not in self._announced:
                self._announced.add(r)
                reason = "exited" if view.exited and not view.lost else "lost"
                never = " It never joined: is it running with the same --log-path on the same shared " \
                        "filesystem?" if view.record is None else ""
                log.error("rank %d %s while %s: %s.%s Restart it %s. Waits for it give up after %.0f s "
                          "(coordination.rejoin_timeout) unless it comes back.", r, reason, doing,
                          view.describe(), never, self.restart_hint(r), self.cfg.rejoin_timeout)
            elif not (view.lost or view.exited) and r in self._announced:
                self._announced.discard(r)
                self._hints.pop(r, None)
                log.warning("rank %d is back (%s)", r, view.describe())
        return down

    # -- what this rank says ----------------------------------------------------------------
    def say(self, message: str, *, beat: bool = False, **fields) -> None:
        if self.heartbeat is not None:
            self.heartbeat.update(message=message, beat=beat, **fields)

    def check_fence(self, probe: bool = True) -> None:
        if self.claim is not None:
            self.claim.check(probe)

    # -- peers -----------------------------------------------------------------------------
    def peer_view(self, rank: int) -> PeerView:
        return self.liveness.read(self.job.heartbeat(rank), rank, run_id=self.run_id)

    def restart_hint(self, rank: int) -> str:
        """The command the peer was started with (from its claim), to print when it is lost."""
        if rank not in self._hints:
            hint = ""
            for gen in reversed(self.job.claim_generations(rank)):
                rec = read_or_none(self.job.claim(rank, gen), kind=CLAIM_KIND)
                if rec is not None:
                    cmd = rec.data.get("command") or ""
                    hint = f"on host {rec.data.get('host')}: {cmd}" if cmd else f"on host {rec.data.get('host')}"
                    break
            self._hints[rank] = hint or f"with the same scripts/run.sh command it was started with (--worker {rank})"
        return self._hints[rank]

    def _check_peers(self, peers: Iterable[int], what: str) -> None:
        now = self.clock.monotonic()
        for r in peers:
            view = self.peer_view(r)
            if self._judge(view, f"waiting for {what}"):
                since = self._lost_since.setdefault(r, now)
                if now - since > self.cfg.rejoin_timeout:
                    raise PeerLost(
                        f"rank {r} did not come back within {self.cfg.rejoin_timeout:.0f} s while this node waited "
                        f"for {what} ({view.describe()}). Restart every node with its original command to "
                        f"resume the run from where it stopped.")
            else:
                self._lost_since.pop(r, None)

    def wait_for(self, probe: Callable[[], T | None], *, what: str, peers: Callable[[], Iterable[int]],
                 dirs: Iterable[Path] = (), status_every: float = 30.0,
                 watch: Callable[[], None] | None = None) -> T:
        """Poll `probe` until it returns a value. Bounded: lost peers end the wait after rejoin_timeout.
        `watch` runs with the liveness checks (another job's master, for pipelined jobs) and may raise."""
        backoff = Backoff(self.cfg.poll_min, self.cfg.poll_max)
        dirs = list(dirs)
        start = self.clock.monotonic()
        next_refresh = start + self.cfg.dir_refresh_interval
        next_liveness = start + min(self.cfg.heartbeat_interval / 2, 2.0)
        next_status = start + status_every
        self._lost_since.clear()
        ops0 = fsops.total()
        while True:
            self.check_fence(probe=False)  # the remembered answer; the claim stat runs with the liveness checks
            result = probe()
            if result is not None:
                self.waits.append({"what": what, "seconds": self.clock.monotonic() - start,
                                   "ops": fsops.total() - ops0})
                return result
            now = self.clock.monotonic()
            if now >= next_liveness:
                self.check_fence()
                blog.check()  # a node whose log file was lost to a full disk stops waiting
                self._check_peers(list(peers()), what)
                if watch is not None:
                    watch()
                next_liveness = now + min(self.cfg.heartbeat_interval / 2, 2.0)
            if now >= next_refresh:
                for d in dirs:
                    fsops.refresh_dir(d)
                next_refresh = now + self.cfg.dir_refresh_interval
            if now >= next_status:
                waiting = list(peers())
                views = "; ".join(self.peer_view(r).describe() for r in waiting[:4])
                log.info("still waiting for %s after %.0f s: %s", what, now - start, views or "-")
                next_status = now + status_every
            self.clock.sleep(backoff.next())


def host() -> str:
    return socket.gethostname()
