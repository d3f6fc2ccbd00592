"""The resident trainer (train.resident, docs/design.md §2 and §9.6): one torchrun per node that
lives across iterations, and the records through which its driver gives it work.

The driver launches it at the first phase 10 after a join or a failure (one rendezvous for all
nodes), then, every iteration, publishes an *order* in the run folder:
`jobs/<job>/nodes/rank-R/trainer/<launch>/order-K.json` with the iteration, the attempt and the
plan (phase 8's plan file, as the per-iteration trainer reads it). The trainer processes of node
R poll for order K+1 with the protocol's backoff (20 ms growing to 0.5 s), train, stage the
checkpoint and write their result records (train/results.py), which the driver reads; phase 11
publishes. Each trainer process also publishes its *state* (`state-L.json`: pid, launch,
idle / loading / training / offloaded, device memory held) for `status` and the timeline.

A trainer outlives nothing it must not: it exits when its driver's process is gone (pid and
start time, checked every second by a thread, also during a step), when this node's claim was
taken over (the fence its environment names), or when torchrun stops it. Any failure ends the
process; the next attempt launches a fresh one from the last durable state.
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from coordination import timeline
from coordination.children import ChildFailed, check_node_and_peers, exited
from coordination.claims import process_start
from coordination.clock import Backoff
from coordination.layout import JobLayout
from coordination.procgroup import Child, start_child
from coordination.records import RecordError, ensure_dir, fence_noticed, publish_record, try_read

log = logging.getLogger("baton.train.resident")

ORDER_KIND = "trainer-order"
STATE_KIND = "resident-trainer"  # coordination/status.py reads it by this name
ENV_DRIVER = "BATON_DRIVER_PROCESS"   # "pid:start" of the driver the trainer works for


def driver_env() -> dict[str, str]:
    """What a trainer needs to notice that the driver launching it died (set in torchrun's env)."""
    pid = os.getpid()
    return {ENV_DRIVER: f"{pid}:{process_start(pid)}"}


# -- the driver's side -----------------------------------------------------------------------
class ResidentTrainer:
    """One node's resident trainer, seen from its driver: launch, give orders, wait, stop."""

    def __init__(self, node, log_file: Path):
        self.node = node
        self.log_file = log_file
        self.proc: Child | None = None
        self.launch_id: str | None = None
        self.seq = 0
        self.launches = 0

    def alive(self) -> str | None:
        """The launch id of a trainer that is still running, else None."""
        if self.proc is not None and self.proc.poll() is None:
            return self.launch_id
        return None

    def launch(self, cmd: list[str], env: dict[str, str], launch_id: str) -> None:
        """Start torchrun for `launch_id` as a child (procgroup.start_child; any older one is stopped
        first). Raises ChildStartError when it does not start within coordination.child_start_timeout."""
        self.stop()
        self.node.check_fence()  # a superseded node starts nothing
        self.proc = start_child(cmd, env={**env, **driver_env()}, log_file=self.log_file,
                                what=f"resident trainer {launch_id}", start_timeout=self.node.cfg.child_start_timeout)
        self.launch_id, self.seq = launch_id, 0
        self.launches += 1
        log.info("launched the resident trainer %s (torchrun pid %d)", launch_id, self.proc.pid)

    def order(self, **data: Any) -> Path:
        """Publish the next order for this node's trainer processes."""
        if self.launch_id is None:
            raise RuntimeError("no resident trainer was launched on this node")
        self.seq += 1
        path = self.node.job.trainer_order(self.node.rank, self.launch_id, self.seq)
        ensure_dir(path.parent)
        publish_record(path, ORDER_KIND, {"seq": self.seq, "launch": self.launch_id, **data},
                       run_id=self.node.run_id, generation=self.node.generation)
        return path

    def wait(self, results: Callable[[], dict[str, Any]], *, peers, what: str,
             on_tick: Callable[[], None] | None = None) -> dict[str, Any]:
        """Until `results()` (train.results.read_results of the ordered attempt) says every rank
        is done: ChildFailed as soon as one rank reports an error, torchrun exits, or a peer is
        lost; Fenced if this node was taken over. Returns the results."""
        backoff = Backoff(0.02, 0.5)
        while True:
            res = results()
            if res["errors"]:
                rank, error = sorted(res["errors"].items())[0]
                raise ChildFailed(f"{what}: trainer rank {rank} failed: {error}")
            if res["ok"]:
                return res
            if self.proc is None or self.proc.poll() is not None:
                child, self.proc, self.launch_id = self.proc, None, None
                if child is None:
                    raise exited(f"{what}: the resident trainer", None, self.log_file)
                child.join_output()  # its last words are what `exited` quotes
                raise exited(f"{what}: the resident trainer", child.returncode, self.log_file, child.log_start)
            check_node_and_peers(self.node, peers, what)
            if on_tick is not None:
                on_tick()
            time.sleep(backoff.next())

    def unreleased(self, iteration: int, local_ranks: int) -> list[str]:
        """Which of this node's trainer processes have not said that they released their device memory
        after training `iteration` (state "offloaded" of this launch and iteration); empty when all
        have. The engine that shares their devices may wake or start only then (docs/design.md §9.6)."""
        job, rank = self.node.job, self.node.rank
        missing = []
        for local in range(local_ranks):
            try:
                rec = try_read(job.trainer_state(rank, local), kind=STATE_KIND, run_id=self.node.run_id)
            except RecordError as exc:
                missing.append(f"local rank {local}: {exc}")
                continue
            said = None if rec is None else (rec.data.get("launch"), rec.data.get("iteration"), rec.data.get("state"))
            if said != (self.launch_id, iteration, "offloaded"):
                missing.append(f"local rank {local}: {'no state record' if said is None else said}")
        return missing

    def close(self, timeout: float) -> None:
        """At the end of a run: order the trainer to stop, so it first finishes writing the last
        iteration's optimizer state (docs/design.md §9.6), and wait up to `timeout` seconds for it
        to exit; then stop whatever is left of its group."""
        if self.alive() is not None:
            self.order(stop=True)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the resident trainer %s did not stop within %.0f s of its stop order; stopping its "
                            "process group (the next run that trains replays the last iteration to make its "
                            "optimizer state again)", self.launch_id, timeout)
        self.stop()

    def stop(self) -> None:
        """Stop the trainer's process group (SIGTERM, then SIGKILL); returns when it is reaped."""
        if self.proc is not None:
            self.proc.stop()
            log.info("stopped the resident trainer %s", self.launch_id)
            try:
                self._mark_stopped()
            except OSError as exc:  # observers' records: a full disk must not hide why the node stops
                log.warning("could not mark the resident trainer %s stopped for `status`: %s", self.launch_id, exc)
        self.proc, self.launch_id, self.seq = None, None, 0

    def _mark_stopped(self) -> None:
        """The stopped processes cannot say so themselves: their state records say it for them."""
        job, rank = self.node.job, self.node.rank
        for local in range(1024):
            path = job.trainer_state(rank, local)
            try:
                rec = try_read(path, kind=STATE_KIND, run_id=self.node.run_id)
            except RecordError:
                continue  # torn or foreign: nothing to correct
            if rec is None:
                return
            if rec.data.get("launch") == self.launch_id and rec.data.get("state") != "stopped":
                publish_record(path, STATE_KIND, {**rec.data, "state": "stopped", "device_memory_mb": 0.0},
                               run_id=self.node.run_id, generation=0, durable=False)


# -- the trainer's side -------------------------------------------------------------------------
class Mailbox:
    """A trainer process's view of its orders and its published state."""

    def __init__(self, job: JobLayout, node_rank: int, launch: str, *, run_id: str, local_rank: int):
        self.job, self.node_rank, self.launch, self.run_id = job, node_rank, launch, run_id
        self.local_rank = local_rank
        self.seq = 0

    def next_order(self) -> dict[str, Any]:
        """Wait for the next order (polls one known name with backoff; the driver watch thread
        ends the process if the driver dies meanwhile)."""
        path = self.job.trainer_order(self.node_rank, self.launch, self.seq + 1)
        backoff = Backoff(0.02, 0.5)
        while True:
            rec = try_read(path, kind=ORDER_KIND, run_id=self.run_id)
            if rec is not None:
                self.seq += 1
                return rec.data
            time.sleep(backoff.next())

    def say(self, state: str, *, iteration: int | None = None, device_memory_mb: float | None = None,
            to_timeline: bool = True, **extra: Any) -> None:
        """Publish this process's state; local rank 0 also adds it to the node's trainer timeline
        (the trainer lane of `report`'s timeline.png) unless `to_timeline` is false (a second record
        of the same state, with its memory)."""
        path = self.job.trainer_state(self.node_rank, self.local_rank)
        ensure_dir(path.parent)
        now = time.time()
        publish_record(path, STATE_KIND,
                       {"pid": os.getpid(), "launch": self.launch, "state": state, "iteration": iteration,
                        "device_memory_mb": device_memory_mb, "rank": int(os.environ.get("RANK", "0")),
                        "time": now, **extra},
                       run_id=self.run_id, generation=0, durable=False)
        if self.local_rank == 0 and to_timeline:
            try:
                timeline.append(self.job.trainer_timeline(self.node_rank), {
                    "job": self.job.name, "rank": self.node_rank, "launch": self.launch, "event": state,
                    "iteration": iteration, "device_memory_mb": device_memory_mb, "wall": now})
            except OSError as exc:  # observers' data: a full disk here must not fail a training step
                log.warning("could not add to the trainer timeline: %s", exc)


def watch_driver(on_gone: Callable[[str], None], every: float = 1.0) -> threading.Thread | None:
    """Start a daemon thread that calls `on_gone(reason)` once the driver named in the environment
    is gone or this node's claim was taken over. None without a driver (tests that run the
    trainer by hand)."""
    spec = os.environ.get(ENV_DRIVER, "")
    pid_text, _, start = spec.partition(":")
    if not pid_text.isdigit():
        return None
    pid = int(pid_text)

    def loop() -> None:
        while True:
            if process_start(pid) != start:
                on_gone(f"its driver (pid {pid}) is gone")
                return
            if fence_noticed(max_age=every):
                on_gone("this node's rank was taken over by a newer generation")
                return
            time.sleep(every)

    thread = threading.Thread(target=loop, name="driver-watch", daemon=True)
    thread.start()
    return thread
