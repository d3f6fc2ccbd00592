"""Heartbeats: a writer thread per rank and a liveness judge on the reader's side (docs/design.md §5 rule 6).

A heartbeat is a record rewritten every `heartbeat_interval` seconds with a counter and a nonce
(random per process), plus what the rank is doing (iteration, phase, message) for `status`.
A reader decides liveness by seeing (nonce, counter) change, timed on its *own* monotonic clock.
It never compares a file's mtime or a remote wall time with the local clock, so clock skew
between nodes and attribute caching on NFS cannot make a live peer look dead or a dead one live.
Half-written or temporarily missing heartbeat files (ENOENT, ESTALE) simply do not count as a
change; they never count as death on their own.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from coordination.clock import Clock
from coordination.records import Fenced, Record, publish_record, read_or_none

log = logging.getLogger("baton.heartbeat")

KIND = "heartbeat"


class HeartbeatWriter:
    """Rewrites `path` every `interval` seconds from a daemon thread.

    `fenced()` is asked before every write; once it says True the writer stops for good and calls
    `on_fenced` (a superseded process must not keep announcing itself)."""

    def __init__(self, path: Path, *, run_id: str, generation: int, job: str, rank: int, interval: float,
                 clock: Clock | None = None, fenced: Callable[[], bool] | None = None,
                 on_fenced: Callable[[], None] | None = None, watch: Callable[[], str | None] | None = None):
        self.path = Path(path)
        self._watch = watch  # stall.MainThreadWatch.check: what the main thread is stuck in, if it is
        self.run_id = run_id
        self.generation = generation
        self.interval = interval
        self.clock = clock or Clock()
        self._fenced = fenced or (lambda: False)
        self._on_fenced = on_fenced
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._published_where: tuple[Any, Any] = (None, None)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.counter = 0
        self._failing: str | None = None  # the write error last warned about, until a write works
        self.state: dict[str, Any] = {
            "nonce": secrets.token_hex(8), "host": socket.gethostname(), "pid": os.getpid(), "job": job,
            "rank": rank, "iteration": None, "phase": None, "phase_name": None, "message": "starting",
            "state": "running", "started_wall": self.clock.wall(),
        }
        self.stopped_by_fence = False

    def update(self, *, beat: bool = False, **fields: Any) -> None:
        """Change what the next heartbeat says. A new iteration or phase is written at once, in the
        caller's thread, so a rank killed right after is reported where it really was (docs/design.md
        §5 rule 6); other `beat=True` updates have the thread write soon, without making the caller
        wait for the filesystem."""
        with self._lock:
            self.state.update(fields)
            moved = (self.state["iteration"], self.state["phase"]) != self._published_where
        if moved:
            self.beat()
        elif beat:
            if self._thread is not None and self._thread.is_alive():
                self._wake.set()
            else:
                self.beat()

    def beat(self, *, last: bool = False) -> bool:
        """Write one heartbeat now. False when fenced (nothing written). A `last` one (the goodbye)
        that fails says so only at debug level: the node's own last line already says why it ends."""
        # One writer at a time: a beat of the thread racing one of a phase change could otherwise
        # rename an older state over the newer one.
        with self._write_lock:
            if self.stopped_by_fence:
                return False
            if self._fenced():
                self._stop_fenced()
                return False
            stuck = self._watch() if self._watch is not None else None
            with self._lock:
                self.counter += 1
                data = dict(self.state, counter=self.counter, wall=self.clock.wall())
            if stuck:
                data["message"], data["stuck"] = f"{data['message']} [{stuck}]", stuck
            try:
                # Not fsynced: a heartbeat is rewritten every few seconds and worthless after a power loss.
                publish_record(self.path, KIND, data, run_id=self.run_id, generation=self.generation, durable=False)
            except Fenced:  # the process-wide guard saw the newer claim between our check and the rename
                self._stop_fenced()
                return False
            except OSError as exc:
                # A shared filesystem hiccup must not kill the rank; peers tolerate a few missed beats.
                # Said once per error, not once per beat: a full disk would flood the console.
                if not last and str(exc) != self._failing:
                    log.warning("could not write heartbeat %s: %s (retrying every %.1f s; said again when the "
                                "error changes)", self.path, exc, self.interval)
                else:
                    log.debug("could not write heartbeat %s: %s", self.path, exc)
                self._failing = str(exc)
            else:
                if self._failing is not None:
                    log.info("heartbeat %s written again", self.path)
                self._failing = None
            self._published_where = (data["iteration"], data["phase"])
            return True

    def _stop_fenced(self) -> None:
        self.stopped_by_fence = True
        self._stop.set()
        if self._on_fenced is not None:
            self._on_fenced()

    # Messages ask for an early beat; on a fast run they come many times a second, so early beats
    # are at least this far apart (status can lag by this much; phase changes do not wait).
    MIN_GAP = 0.5

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval)
            if self._stop.is_set():
                return
            self._stop.wait(self.MIN_GAP)
            self._wake.clear()
            if self._stop.is_set() or not self.beat():
                return

    def start(self) -> "HeartbeatWriter":
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="baton-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self, final_state: str | None = None, message: str | None = None) -> None:
        """Stop the thread; with `final_state` ("exited", "stopped", "failed") write one last beat
        so observers can tell a clean exit from a lost node."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.interval, 1.0) + 5)
        if final_state is not None and not self.stopped_by_fence:
            with self._lock:
                self.state.update(state=final_state, message=message or final_state, waiting_for=[])
            self.beat(last=True)


@dataclass
class PeerView:
    """What an observer knows about one peer."""

    rank: int
    record: Record | None      # last valid heartbeat seen (any age)
    first_seen: float          # observer's monotonic time when it started watching
    last_change: float         # observer's monotonic time of the last (nonce, counter) change
    silent_for: float          # seconds since last_change, on the observer's clock
    lost: bool
    exited: bool               # the peer said goodbye (clean exit, failure or stop)

    @property
    def host(self) -> str:
        return self.record.data.get("host", "?") if self.record else "?"

    @property
    def pid(self) -> int | None:
        return self.record.data.get("pid") if self.record else None

    def describe(self) -> str:
        if self.record is None:
            return f"rank {self.rank}: no heartbeat yet (watched for {self.silent_for:.0f} s)"
        d = self.record.data
        where = f"iteration {d.get('iteration')}, phase {d.get('phase')} {d.get('phase_name') or ''}".rstrip()
        return (f"rank {self.rank} (host {d.get('host')}, pid {d.get('pid')}, generation {self.record.generation}) "
                f"last seen {self.silent_for:.0f} s ago at {where}: {d.get('message')}")


def _older(key: tuple, than: tuple | None) -> bool:
    """A read of the same process's heartbeat with a lower counter: it was in flight while a
    newer one was seen (two threads read), not a sign of life."""
    return (than is not None and key[0] == than[0] and key[2] == than[2]
            and isinstance(key[1], int) and isinstance(than[1], int) and key[1] < than[1])


class LivenessTracker:
    """Judges peers alive or lost from their heartbeat files, on this node's monotonic clock.

    The silence is timed from the moment this node *saw* a change, so the node must look often:
    a node busy in a long action feeds it from a background reader (`Node` starts one), otherwise
    a peer that died while the node was busy would be timed from the node's next look and named
    up to that much late (docs/design.md §5 rule 6). Safe to feed from several threads."""

    def __init__(self, peer_timeout: float, clock: Clock | None = None):
        self.peer_timeout = peer_timeout
        self.clock = clock or Clock()
        self._seen: dict[int, tuple[Any, float, float, Record | None]] = {}
        self._lock = threading.Lock()

    def observe(self, rank: int, record: Record | None, min_generation: int = 0) -> PeerView:
        """Feed the latest read of a peer's heartbeat (None if unreadable or missing).

        Records of a generation below `min_generation` come from a superseded process and do not
        count as signs of life of the rank."""
        if record is not None and record.generation < min_generation:
            record = None
        key = (record.data.get("nonce"), record.data.get("counter"), record.generation) if record else None
        with self._lock:
            now = self.clock.monotonic()
            prev = self._seen.get(rank)
            if prev is None:
                first_seen, last_change, last_key, last_rec = now, now, key, record
            else:
                last_key, first_seen, last_change, last_rec = prev
                if key is not None and key != last_key and not _older(key, last_key):
                    last_key, last_change = key, now
                if record is not None:
                    last_rec = record
            self._seen[rank] = (last_key, first_seen, last_change, last_rec)
        silent = now - last_change
        exited = bool(last_rec and last_rec.data.get("state") in ("exited", "failed", "stopped"))
        return PeerView(rank, last_rec, first_seen, last_change, silent, silent > self.peer_timeout, exited)

    def read(self, path: Path, rank: int, *, run_id: str, min_generation: int = 0) -> PeerView:
        rec = read_or_none(path, kind=KIND, run_id=run_id)  # another run's file: not this peer's sign of life
        return self.observe(rank, rec, min_generation)

    def last_record(self, rank: int) -> Record | None:
        with self._lock:
            prev = self._seen.get(rank)
        return prev[3] if prev else None
