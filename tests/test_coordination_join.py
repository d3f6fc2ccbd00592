"""Joining a run: manifests, config checks, unsafe log paths, garbage collection, fast commands."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordination.clock import FakeClock
from coordination.layout import RunLayout
from coordination.manifest import (JoinRefused, accept_resume, ensure_job, join_run_as_worker, open_run_as_master,
                                   read_config_yaml)
from coordination.records import read_record
from tests.procs import ROOT, bench_node, env

CFG_A = {"train": {"lr": 0.001, "steps": 4}, "logging": {"tensorboard": False}}
CFG_B = {"train": {"lr": 0.002, "steps": 4}, "logging": {"tensorboard": False}}


def test_master_creates_the_run_once_and_a_restart_joins_it(run_dir):
    lay = RunLayout(run_dir)
    a = open_run_as_master(lay, CFG_A, resume=False)
    b = open_run_as_master(lay, CFG_A, resume=False)
    assert a.run_id == b.run_id and read_record(lay.run_json).run_id == a.run_id


def test_changed_config_is_refused_unless_resumed_and_the_change_is_recorded(run_dir):
    lay = RunLayout(run_dir)
    info = open_run_as_master(lay, CFG_A, resume=False)
    with pytest.raises(JoinRefused, match=r"(?s)train.lr: 0.001 -> 0.002.*--resume"):
        open_run_as_master(lay, CFG_B, resume=False)
    again = open_run_as_master(lay, CFG_B, resume=True)
    assert again.run_id == info.run_id
    assert "lr: 0.001" in lay.config_yaml.read_text(), "published before the rank was claimed"
    accept_resume(lay, again)  # join_job calls it once the master holds rank 0
    change = read_record(lay.config_change(1))
    assert change.data["changes"] == ["train.lr: 0.001 -> 0.002"]
    assert "lr: 0.002" in lay.config_yaml.read_text()


def test_node_local_keys_may_differ_between_nodes(run_dir):
    lay = RunLayout(run_dir)
    open_run_as_master(lay, CFG_A, resume=False)
    local = dict(CFG_A, logging={"tensorboard": True})
    join_run_as_worker(lay, local, join_timeout=1)


def test_worker_with_another_config_is_refused_with_both_values(run_dir):
    lay = RunLayout(run_dir)
    open_run_as_master(lay, CFG_A, resume=False)
    with pytest.raises(JoinRefused, match=r"(?s)config differs.*train.lr: 0.001 -> 0.002"):
        join_run_as_worker(lay, CFG_B, join_timeout=1)


def test_worker_without_a_master_names_the_log_path_it_watches(run_dir):
    clock = FakeClock()
    with pytest.raises(JoinRefused, match=rf"(?s){run_dir}.*same shared filesystem"):
        join_run_as_worker(RunLayout(run_dir), CFG_A, join_timeout=30, clock=clock)
    assert clock.monotonic() - 1000 >= 30


def test_folder_with_foreign_files_is_not_taken_for_a_new_run(run_dir):
    (run_dir / "results.csv").write_text("x")
    with pytest.raises(JoinRefused, match="not empty"):
        open_run_as_master(RunLayout(run_dir), CFG_A, resume=False)


def test_world_writable_log_path_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(JoinRefused, match="chmod o-w"):
        open_run_as_master(RunLayout(d), CFG_A, resume=False)


def test_job_facts_must_match(run_dir):
    lay = RunLayout(run_dir)
    info = open_run_as_master(lay, CFG_A, resume=False)
    job = lay.job("both")
    ensure_job(job, info.run_id, {"num_nodes": 2, "rank_weights": [2, 1]}, master=True)
    with pytest.raises(JoinRefused, match=r"rank_weights: \[2, 1\] in the run, \[1, 1\] here"):
        ensure_job(job, info.run_id, {"num_nodes": 2, "rank_weights": [1, 1]}, master=False)


def test_master_removes_barrier_folders_older_than_the_window(procs, run_dir):
    hb = ["--heartbeat-interval", "0.5", "--peer-timeout", "3", "--gc-keep-iterations", "2"]
    for r in range(2):
        procs.start(f"r{r}", bench_node(run_dir, r, 2, 5, *hb))
    assert procs.wait_all(60) == {"r0": 0, "r1": 0}
    sync = RunLayout(run_dir).job("both").sync_dir
    assert sorted(p.name for p in sync.iterdir()) == ["iter-4", "iter-5"]


def test_worker_gives_up_joining_with_a_clear_message(procs, run_dir):
    procs.start("w", bench_node(run_dir, 1, 2, 2, "--join-timeout", "2"))
    assert procs.wait("w", 30) == 3
    assert "same shared filesystem" in procs.log("w") and str(run_dir) in procs.log("w")


def test_commands_start_without_importing_torch(run_dir):
    code = ("import sys; from click.testing import CliRunner; from coordination.__main__ import main; "
            "r = CliRunner().invoke(main, ['status', '--log-path', sys.argv[1]]); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)], cwd=ROOT, env=env(), capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr


def _wait_for(pred, timeout: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_refused_resume_changes_neither_config_yaml_nor_the_change_history(procs, run_dir):
    """A --resume refused because rank 0 is held by a live master rewrote config.yaml and recorded
    a change; a worker with the run's real config was then refused."""
    from coordination.claims import ClaimRefused
    from coordination.config import CoordinationConfig
    from coordination.join import join_job

    lay = RunLayout(run_dir)
    hb = ["--heartbeat-interval", "0.3", "--peer-timeout", "3"]
    procs.start("master", bench_node(run_dir, 0, 2, 2, *hb))  # waits at barrier 0 for a worker never started
    _wait_for(lambda: lay.job("both").heartbeat(0).exists() and lay.job("both").master_json.exists(), 30,
              "the bench master to join")
    before = lay.config_yaml.read_bytes()
    real = read_config_yaml(lay)
    changed = dict(real, bench={"nodes": 2, "iterations": 7})
    with pytest.raises((ClaimRefused, JoinRefused), match="already held by a live process"):
        join_job(lay, job="both", rank=0, num_nodes=2, job_facts={"rank_weights": [1, 1]}, config=changed,
                 cfg=CoordinationConfig(heartbeat_interval=0.3, peer_timeout=3), resume=True)
    assert lay.config_yaml.read_bytes() == before
    assert not lay.config_changes_dir.exists()
    join_run_as_worker(lay, real, join_timeout=1)  # the run's config still admits its workers


_RACER = """
import sys, time
from pathlib import Path
from coordination.layout import RunLayout
from coordination.manifest import JoinRefused, open_run_as_master
root, lr, go, ready = Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
ready.write_text("ready")
while not go.exists():
    time.sleep(0.001)
try:
    open_run_as_master(RunLayout(root), {"train": {"lr": lr}, "pad": "x" * 200000}, resume=False)
    print("joined")
except JoinRefused as exc:
    print("refused")
"""


def test_masters_racing_with_different_configs_leave_config_yaml_matching_run_json(tmp_path):
    """config.yaml was written before the exclusive create of run.json, so a losing master with
    another config could overwrite the winner's."""
    import time

    from coordination.manifest import _hash_of

    for rnd in range(4):
        root = tmp_path / f"run{rnd}"
        root.mkdir(mode=0o750)
        go = tmp_path / f"go{rnd}"
        ready = [tmp_path / f"ready{rnd}-{i}" for i in range(4)]
        racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(root), str(0.001 * (i + 1)), str(go),
                                    str(ready[i])], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True)
                  for i in range(4)]
        try:
            deadline = time.monotonic() + 30
            while not all(r.exists() for r in ready) and time.monotonic() < deadline:
                time.sleep(0.01)  # every racer imported and polls the start file
            go.write_text("go")
            outs = [p.communicate(timeout=60)[0].strip() for p in racers]
        finally:
            for p in racers:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        lay = RunLayout(root)
        assert outs.count("joined") == 1, outs
        assert _hash_of(read_config_yaml(lay)) == read_record(lay.run_json).data["config_hash"], f"round {rnd}: {outs}"


def test_a_job_json_seen_empty_for_a_moment_is_read_again_not_refused(tmp_path):
    """On a network filesystem the master's exclusive create can be seen before its content: a
    second master (or a worker) that reads it then must wait, bounded, instead of failing."""
    import threading

    from coordination.manifest import JoinRefused, ensure_job
    from coordination.records import encode_record

    job = RunLayout(tmp_path).job("both")
    job.job_json.parent.mkdir(parents=True)
    job.job_json.write_bytes(b"")                      # created, content not there yet
    facts = {"num_nodes": 2, "rank_weights": [1.0, 1.0]}
    later = threading.Timer(0.3, lambda: job.job_json.write_bytes(encode_record("job", facts, run_id="r", generation=0)))
    later.start()
    try:
        assert ensure_job(job, "r", facts, master=True) == facts
    finally:
        later.cancel()
    job.job_json.write_bytes(b"{")                     # stays cut off: refused once the bound is over
    with pytest.raises(JoinRefused, match=r"not yet visible on this mount \(attribute cache\) after 1 s"):
        ensure_job(job, "r", facts, master=False, settle=1.0)
