"""The coordination promises, tested with real processes on real files (issue 2)."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from coordination import exits, timeline
from coordination.layout import RunLayout
from tests.procs import bench_node, wait_for_text
from tests.zombie import HB, zombie_changes_nothing  # HB: fast heartbeats for every test here



def _actions(run_dir: Path, rank: int) -> list[dict]:
    return list(timeline.read(RunLayout(run_dir).bench_work("both", rank)))


def test_eight_processes_fifty_barrier_rounds_never_release_early_or_lose_anyone(procs, run_dir):
    n, rounds = 8, 50
    for r in range(n):
        procs.start(f"r{r}", [sys.executable, "-m", "tests.barrier_rounds", str(run_dir), str(r), str(n), str(rounds)])
    codes = procs.wait_all(timeout=240)
    assert codes == {f"r{r}": 0 for r in range(n)}, {k: procs.log(k)[-800:] for k, c in codes.items() if c}
    for r in range(n):
        last = procs.log(f"r{r}").strip().splitlines()[-1]
        assert json.loads(last)["rounds"] == list(range(1, rounds + 1))


def test_killed_rank_is_named_by_every_survivor_and_resumes_where_it_stopped(procs, run_dir):
    n = 3
    slow = ["--slow", "1:2:6"]  # rank 2 works 6 s in phase 1 of every iteration
    for r in range(n):
        procs.start(f"r{r}", bench_node(run_dir, r, n, 2, *HB, *slow))
    wait_for_text(procs, "r2", "working 6.0 s in phase 1", 60)
    time.sleep(1.0)
    procs.signal("r2", signal.SIGKILL)
    killed = time.monotonic()
    procs.wait("r2", 10)
    for r in (0, 1):  # every survivor names the dead rank, within peer_timeout + 2 heartbeats (+ poll slack)
        seen = wait_for_text(procs, f"r{r}", "rank 2 lost", 30)
        assert seen - killed <= 3 + 2 * 0.5 + 1.5, f"rank {r} named the lost rank {seen - killed:.1f} s after the kill"
        log = procs.log(f"r{r}")
        assert "Restart it on host" in log and "--node-rank 2" in log
    # restart with the same command: it takes over at once (same host, pid gone) and resumes
    procs.start("r2-again", bench_node(run_dir, 2, n, 2, *HB, *slow))
    codes = procs.wait_all(timeout=120)
    assert codes["r0"] == codes["r1"] == codes["r2-again"] == 0, procs.log("r2-again")[-2000:]
    assert "rank 2 is back" in procs.log("r0")
    acts = _actions(run_dir, 2)
    first_gen2 = [a for a in acts if a["generation"] == 2][0]
    assert (first_gen2["iteration"], first_gen2["phase"]) == (1, 1), "did not resume at the phase it was killed in"
    done_once = [(a["iteration"], a["phase"]) for a in acts if a["generation"] == 2]
    assert len(done_once) == len(set(done_once)), "the restarted rank redid a phase"
    assert RunLayout(run_dir).job("both").claim(2, 2).exists()


def test_paused_rank_is_fenced_once_replaced_and_exits_without_writing(procs, run_dir):
    n = 2
    slow = ["--slow", "1:1:8", "--slow-iterations", "1"]
    procs.start("r0", bench_node(run_dir, 0, n, 2, *HB, *slow))
    procs.start("r1", bench_node(run_dir, 1, n, 2, *HB, *slow))
    wait_for_text(procs, "r1", "working 8.0 s in phase 1", 60)
    procs.signal("r1", signal.SIGSTOP)
    wait_for_text(procs, "r0", "rank 1 lost", 30)
    procs.start("r1-new", bench_node(run_dir, 1, n, 2, *HB, *slow))
    wait_for_text(procs, "r1-new", "took over rank 1", 60)
    hb = RunLayout(run_dir).job("both").heartbeat(1)
    procs.signal("r1", signal.SIGCONT)
    assert procs.wait("r1", 30) == exits.FENCED
    assert "taken over" in procs.log("r1") or "was superseded" in procs.log("r1")
    codes = procs.wait_all(timeout=120)
    assert codes["r0"] == 0 and codes["r1-new"] == 0, procs.log("r1-new")[-2000:]
    from coordination.records import read_record
    assert read_record(hb).generation == 2
    gen1_after = [a for a in _actions(run_dir, 1) if a["generation"] == 1 and (a["iteration"], a["phase"]) > (1, 1)]
    assert gen1_after == [], "the fenced process kept acting after it woke up"


def test_second_live_process_for_a_rank_is_refused_with_host_and_pid(procs, run_dir):
    procs.start("r0", bench_node(run_dir, 0, 2, 2, *HB, "--slow", "0:0:20"))
    procs.start("r1", bench_node(run_dir, 1, 2, 2, *HB))
    wait_for_text(procs, "r1", "joined run", 60)
    procs.start("dup", bench_node(run_dir, 1, 2, 2, *HB))
    assert procs.wait("dup", 60) == exits.REFUSED
    log = procs.log("dup")
    assert "already held by a live process" in log and f"pid {procs.procs['r1'].pid}" in log


def test_node_with_a_different_config_is_refused_showing_both(procs, run_dir):
    procs.start("r0", bench_node(run_dir, 0, 2, 2, *HB, "--slow", "0:0:20"))
    wait_for_text(procs, "r0", "joined run", 60)
    procs.start("bad", bench_node(run_dir, 1, 2, 3, *HB))  # --iterations 3 instead of 2
    assert procs.wait("bad", 60) == exits.REFUSED
    log = procs.log("bad")
    assert "config differs" in log and "bench.iterations: 2 -> 3" in log


def test_failed_training_attempt_is_retried_and_run_finishes(procs, run_dir):
    for r in range(2):
        procs.start(f"r{r}", bench_node(run_dir, r, 2, 1, *HB, "--fail", "10:1:1"))
    assert procs.wait_all(60) == {"r0": 0, "r1": 0}
    attempts = sorted({a["attempt"] for a in _actions(run_dir, 1) if a["phase"] == 10})
    assert attempts == [1, 2]
    assert "asked for attempt 2" in procs.log("r1")


def test_failed_phase_aborts_every_node_with_the_reason(procs, run_dir):
    for r in range(2):
        procs.start(f"r{r}", bench_node(run_dir, r, 2, 2, *HB, "--fail", "3:0:1"))
    codes = procs.wait_all(60)
    assert codes == {"r0": exits.ABORTED, "r1": exits.ABORTED}
    for r in range(2):
        assert "failed at phase 4 train-files-ready: rank 0: phase 3 aggregate-train: RuntimeError: injected" \
               in procs.log(f"r{r}")


def test_stop_request_ends_the_run_after_the_current_iteration(procs, run_dir):
    for r in range(2):
        procs.start(f"r{r}", bench_node(run_dir, r, 2, 50, *HB, "--slow", "1:1:1.5"))
    wait_for_text(procs, "r1", "working 1.5 s in phase 1", 60)
    from coordination.records import publish_record
    publish_record(RunLayout(run_dir).stop_file, "stop", {"by": "test"}, run_id="any", generation=0)
    assert procs.wait_all(60) == {"r0": 0, "r1": 0}
    its = {a["iteration"] for a in _actions(run_dir, 0)}
    assert max(its) <= 2, its
    assert "STOP requested" in procs.log("r0")


def test_peer_dying_while_the_master_is_busy_is_named_within_peer_timeout_at_its_real_phase(procs, run_dir):
    # The master works 6 s in phase 3 (longer than peer_timeout 3 s) while the worker, which has no
    # part in phase 3, waits at barrier 4; the worker dies there. The master must name it within
    # peer_timeout + heartbeat_interval of its last beat (the kill is after it), at phase 4.
    slow = ["--slow", "3:0:6", "--slow-iterations", "1"]
    for r in range(2):
        procs.start(f"r{r}", bench_node(run_dir, r, 2, 2, *HB, *slow))
    wait_for_text(procs, "r0", "working 6.0 s in phase 3", 60)
    time.sleep(1.0)
    procs.signal("r1", signal.SIGKILL)
    killed = time.monotonic()
    procs.wait("r1", 10)
    seen = wait_for_text(procs, "r0", "rank 1 lost", 30)
    took = seen - killed
    print(f"named {took:.2f} s after the kill (bound peer_timeout + heartbeat_interval = 3.5 s)")
    assert took <= 3 + 0.5 + 0.3, f"the master named the dead rank {took:.1f} s after the kill"
    line = next(ln for ln in procs.log("r0").splitlines() if "rank 1 lost" in ln)
    assert "at iteration 1, phase 4 train-files-ready" in line, line


def test_fenced_zombie_changes_no_file_under_the_log_path_after_it_wakes(procs, run_dir):
    zombie_changes_nothing(procs, run_dir, (run_dir, run_dir, run_dir))
