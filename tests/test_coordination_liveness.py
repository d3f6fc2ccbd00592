"""Heartbeats and liveness judged on the reader's clock (fake clock), fencing of stale arrivals,
and bounded waits that name a lost peer."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from coordination.barrier import Barrier
from coordination.clock import FakeClock
from coordination.config import CoordinationConfig
from coordination.heartbeat import KIND, HeartbeatWriter, LivenessTracker
from coordination.layout import RunLayout
from coordination.node import Node, PeerLost
from coordination.records import Record, create_record, publish_record


def _rec(counter: int, nonce: str = "n1", generation: int = 1, state: str = "running") -> Record:
    return Record(KIND, "r", generation, {"counter": counter, "nonce": nonce, "state": state, "host": "h",
                                          "pid": 1, "iteration": 1, "phase": 2, "message": "m"}, 0.0, Path("x"))


def test_peer_is_lost_only_after_peer_timeout_without_counter_change():
    clock = FakeClock()
    t = LivenessTracker(peer_timeout=10, clock=clock)
    assert not t.observe(1, _rec(1)).lost
    clock.advance(9)
    assert not t.observe(1, _rec(1)).lost           # same counter, but not for long enough
    clock.advance(2)
    view = t.observe(1, _rec(1))
    assert view.lost and view.silent_for == pytest.approx(11)
    assert not t.observe(1, _rec(2)).lost           # it moved: alive again at once


def test_missing_or_half_written_heartbeat_is_not_death_by_itself():
    clock = FakeClock()
    t = LivenessTracker(peer_timeout=10, clock=clock)
    t.observe(1, _rec(1))
    for _ in range(4):
        clock.advance(2)
        assert not t.observe(1, None).lost          # ENOENT / ESTALE / torn reads
    clock.advance(0.5)
    assert not t.observe(1, _rec(2)).lost


def test_restarted_peer_with_new_nonce_counts_as_alive_even_if_counter_repeats():
    clock = FakeClock()
    t = LivenessTracker(peer_timeout=10, clock=clock)
    t.observe(1, _rec(5, "old"))
    clock.advance(9)
    view = t.observe(1, _rec(5, "new", generation=2))
    assert view.last_change == clock.monotonic()


def test_heartbeat_of_a_superseded_generation_is_no_sign_of_life():
    clock = FakeClock()
    t = LivenessTracker(peer_timeout=10, clock=clock)
    t.observe(1, _rec(1, generation=2), min_generation=2)
    for c in range(2, 8):
        clock.advance(2)
        view = t.observe(1, _rec(c, generation=1), min_generation=2)
    assert view.lost


def test_heartbeat_writer_counts_up_and_stops_when_fenced(tmp_path: Path):
    fenced = {"now": False}
    hb = tmp_path / "hb.json"
    w = HeartbeatWriter(hb, run_id="r", generation=3, job="both", rank=1, interval=5, clock=FakeClock(),
                        fenced=lambda: fenced["now"])
    assert w.beat() and w.beat()
    t = LivenessTracker(10, FakeClock())
    assert t.read(hb, 1, run_id="r").record.data["counter"] == 2
    fenced["now"] = True
    assert not w.beat()
    assert t.read(hb, 1, run_id="r").record.data["counter"] == 2  # nothing written once fenced
    assert w.stopped_by_fence


def _node(tmp_path: Path, rank: int, clock: FakeClock, num_nodes: int = 3, generation: int = 1) -> Node:
    cfg = CoordinationConfig(heartbeat_interval=1, peer_timeout=5, rejoin_timeout=20, poll_min=0.02, poll_max=1.0)
    lay = RunLayout(tmp_path)
    job = lay.job("both")
    create_record(job.claim(rank, generation), "claim", {"host": "h", "pid": 1, "command": f"run.sh --worker {rank}"},
                  run_id="r", generation=generation)
    return Node(lay, job, "r", rank, num_nodes, cfg, clock, generation)


def test_master_ignores_arrival_of_a_superseded_generation(tmp_path: Path):
    clock = FakeClock()
    master = _node(tmp_path, 0, clock)
    w1 = _node(tmp_path, 1, clock)
    w2 = _node(tmp_path, 2, clock)
    Barrier(w1, 1, 2, "train-rollout-done").arrive(payload={"who": "stale gen 1"})
    Barrier(w2, 1, 2, "train-rollout-done").arrive()
    # rank 1 is taken over by generation 2: its generation-1 arrival no longer counts
    create_record(master.job.claim(1, 2), "claim", {"host": "h", "pid": 2}, run_id="r", generation=2)
    b = Barrier(master, 1, 2, "train-rollout-done")
    b.arrive()
    got = {}
    probe_rounds = []

    def fake_sleep(s, _orig=clock.sleep):
        probe_rounds.append(s)
        if len(probe_rounds) == 3:  # the new generation arrives a little later
            w1new = _node(tmp_path, 1, clock, generation=2)
            Barrier(w1new, 1, 2, "train-rollout-done").arrive(payload={"who": "gen 2"})
        _orig(s)

    clock.sleep = fake_sleep
    got = b.wait_arrivals([0, 1, 2])
    assert got[1].generation == 2 and got[1].payload == {"who": "gen 2"}
    assert len(probe_rounds) >= 3


def test_restarted_rank_adopts_its_predecessors_arrival(tmp_path: Path):
    clock = FakeClock()
    old = _node(tmp_path, 1, clock, generation=1)
    Barrier(old, 4, 2, "train-rollout-done").arrive(payload={"tasks": 12})
    new = _node(tmp_path, 1, clock, generation=2)
    mine = Barrier(new, 4, 2, "train-rollout-done").own_arrival()
    assert mine is not None and mine.generation == 2 and mine.payload == {"tasks": 12}


def test_wait_names_a_lost_peer_with_its_restart_command_then_gives_up(tmp_path: Path, caplog):
    clock = FakeClock()
    worker = _node(tmp_path, 1, clock, num_nodes=2)
    _node(tmp_path, 0, clock, num_nodes=2)  # the master's claim exists; it never writes a heartbeat
    publish_record(worker.job.heartbeat(0), KIND, {"counter": 1, "nonce": "x", "host": "hostA", "pid": 42,
                                                  "iteration": 3, "phase": 9, "phase_name": "training-ready",
                                                  "message": "waiting"}, run_id="r", generation=1)
    named_at = []

    class _When(logging.Handler):
        def emit(self, record):
            if "rank 0 lost" in record.getMessage():
                named_at.append(clock.monotonic())

    handler = _When()
    logging.getLogger("baton").addHandler(handler)
    start = clock.monotonic()
    b = Barrier(worker, 3, 9, "training-ready")
    try:
        with caplog.at_level(logging.ERROR, logger="baton"), \
                pytest.raises(PeerLost, match="rank 0 did not come back"):
            b.wait_go()
    finally:
        logging.getLogger("baton").removeHandler(handler)
    lost = [r.getMessage() for r in caplog.records if "rank 0 lost" in r.getMessage()]
    assert len(lost) == 1, "the lost master must be named once, not on every poll"
    assert "hostA" in lost[0] and "pid 42" in lost[0] and "phase 9" in lost[0] and "run.sh --worker 0" in lost[0]
    # named within peer_timeout + 2 heartbeat intervals, gave up only after rejoin_timeout
    assert 5 < named_at[0] - start <= 5 + 2 * 1
    assert clock.monotonic() - named_at[0] >= 20


def test_arrival_that_stays_garbage_is_retried_then_reported(tmp_path: Path):
    from coordination.records import BrokenRecord

    clock = FakeClock()
    master = _node(tmp_path, 0, clock, num_nodes=2)
    master.cfg = dataclasses.replace(master.cfg, rejoin_timeout=1000)  # rank 1 writes no heartbeat here
    _node(tmp_path, 1, clock, num_nodes=2)
    b = Barrier(master, 2, 4, "train-files-ready")
    b.arrive()
    bad = master.job.arrival(2, 4, "train-files-ready", 1)
    bad.write_bytes(b'{"format": "baton/1", "kind": "arri')  # torn write that never completes
    with pytest.raises(BrokenRecord, match=r"rank-1.*unusable for more than 60 s"):
        b.wait_arrivals([0, 1])
    assert clock.monotonic() - 1000 >= 60
