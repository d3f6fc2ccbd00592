"""status, recover and stop on real run folders."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordination.heartbeat import KIND
from coordination.layout import RunLayout
from coordination.records import create_record, publish_record, read_record
from tests.procs import ROOT, bench_node, env

RUN = "run123"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordination", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=60)


def _fixture_run(root: Path) -> RunLayout:
    """A run with a live master waiting at barrier 2 for rank 2, a live rank 1 and a dead rank 2."""
    lay = RunLayout(root)
    create_record(lay.run_json, "run", {"config_hash": "abc", "created_by": "a:1"}, run_id=RUN, generation=0)
    job = lay.job("both")
    create_record(job.job_json, "job", {"num_nodes": 3, "rank_weights": [2, 1, 1]}, run_id=RUN, generation=0)
    now = time.time()
    beats = {
        0: dict(host="node-a", pid=101, iteration=4, phase=2, phase_name="train-rollout-done",
                message="waiting at barrier 2 train-rollout-done of iteration 4 for ranks [2]", waiting_for=[2],
                wall=now - 1),
        1: dict(host="node-b", pid=202, iteration=4, phase=2, phase_name="train-rollout-done",
                message="waiting at barrier 2 for the master's GO", wall=now - 2),
        2: dict(host="node-c", pid=303, iteration=4, phase=1, phase_name="train-rollout",
                message="rolling out 312/500 tasks", wall=now - 600),
    }
    for r, d in beats.items():
        create_record(job.claim(r, 1), "claim", {"host": d["host"], "pid": d["pid"]}, run_id=RUN, generation=1)
        publish_record(job.heartbeat(r), KIND, dict(d, counter=5, nonce="x", state="running"), run_id=RUN,
                       generation=1)
    publish_record(lay.metrics(3), "metrics", {"train_reward_mean": 0.4, "eval_accuracy": 0.31}, run_id=RUN,
                   generation=0)
    return lay


def test_status_shows_live_and_lost_ranks_and_what_the_run_waits_for(run_dir):
    _fixture_run(run_dir)
    res = _cli("status", "--log-path", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    snap = json.loads(res.stdout)
    rows = {r["rank"]: r for r in snap["jobs"][0]["ranks"]}
    assert [rows[r]["state"] for r in (0, 1, 2)] == ["alive", "alive", "lost"]
    assert rows[2]["host"] == "node-c" and rows[2]["phase"] == 1 and rows[2]["iteration"] == 4
    assert snap["jobs"][0]["waiting"] == ("barrier 2 train-rollout-done: waiting for rank 2 (host node-c), lost, "
                                          "rolling out 312/500 tasks")
    assert snap["latest_metrics"]["eval_accuracy"] == 0.31
    table = _cli("status", "--log-path", str(run_dir))
    assert table.returncode == 0
    for text in ("node-c", "lost", "rolling out 312/500 tasks", "eval accuracy 0.310", "waiting for rank 2"):
        assert text in table.stdout, text


def test_status_never_writes_to_the_log_path(run_dir):
    _fixture_run(run_dir)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    assert _cli("status", "--log-path", str(run_dir)).returncode == 0
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    assert before == after


def test_status_on_a_folder_without_a_run_says_so(tmp_path):
    res = _cli("status", "--log-path", str(tmp_path))
    assert res.returncode == 1 and "no baton run" in res.stderr


def test_recover_lists_then_removes_only_leftovers(run_dir):
    lay = _fixture_run(run_dir)
    job = lay.job("both")
    tmp = job.node_dir(2) / ".heartbeat.json.tmp-node-c-303-abcd"
    tmp.write_text("half")
    os.utime(tmp, (time.time() - 3600, time.time() - 3600))
    staging = lay.checkpoint_staging(4, 1)
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"partial")
    done = lay.checkpoint(3)
    done.mkdir(parents=True)
    (done / "model.safetensors").write_bytes(b"complete")
    dry = _cli("recover", "--log-path", str(run_dir))
    assert dry.returncode == 0, dry.stderr
    for p in (tmp, staging):
        assert str(p.relative_to(run_dir)) in dry.stdout
        assert p.exists(), "a dry run removed something"
    assert "iter-3" not in dry.stdout
    refused = _cli("recover", "--log-path", str(run_dir), "--apply")
    assert refused.returncode == 1 and "look alive" in refused.stderr and tmp.exists()
    for r in (0, 1):  # stop the live nodes (their final heartbeat says so)
        rec = read_record(job.heartbeat(r))
        publish_record(job.heartbeat(r), KIND, dict(rec.data, state="exited"), run_id=RUN, generation=1)
    res = _cli("recover", "--log-path", str(run_dir), "--apply")
    assert res.returncode == 0, res.stderr
    assert not tmp.exists() and not staging.exists()
    assert (done / "model.safetensors").read_bytes() == b"complete"
    assert job.claim(2, 1).exists(), "claim files are the fencing history and must stay"


def test_reset_phase_makes_that_phase_run_again_after_restart(procs, run_dir):
    hb = ["--heartbeat-interval", "0.5", "--peer-timeout", "3"]
    for r in range(2):
        procs.start(f"a{r}", bench_node(run_dir, r, 2, 2, *hb))
    assert procs.wait_all(60) == {"a0": 0, "a1": 0}
    res = _cli("recover", "--log-path", str(run_dir), "--reset-phase", "2:10", "--apply", "--peer-timeout", "3")
    assert res.returncode == 0, res.stderr
    assert "10-train" in res.stdout and "13-iteration-done" in res.stdout and "09-training-ready" not in res.stdout
    for r in range(2):
        procs.start(f"b{r}", bench_node(run_dir, r, 2, 2, *hb))
    assert procs.wait_all(60)["b0"] == 0
    from coordination import timeline
    acts = list(timeline.read(RunLayout(run_dir).bench_work("both", 1)))
    runs = [(a["iteration"], a["phase"]) for a in acts]
    assert runs.count((2, 10)) == 2 and runs.count((2, 12)) == 2
    assert runs.count((2, 9)) == 1 and runs.count((1, 10)) == 1


def test_reset_phase_refuses_a_bad_spec(run_dir):
    _fixture_run(run_dir)
    res = _cli("recover", "--log-path", str(run_dir), "--reset-phase", "two:ten")
    assert res.returncode == 1 and "ITER:PHASE" in res.stderr


def test_stop_command_writes_a_stop_request_and_cancel_withdraws_it(run_dir):
    lay = _fixture_run(run_dir)
    res = _cli("stop", "--log-path", str(run_dir))
    assert res.returncode == 0 and lay.stop_file.exists()
    assert read_record(lay.stop_file, run_id=RUN).kind == "stop"
    assert _cli("stop", "--log-path", str(run_dir), "--cancel").returncode == 0
    assert not lay.stop_file.exists()


def _wrapper(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / f"{name}.sh"), *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=60)


def test_stop_on_a_finished_run_says_so_and_writes_nothing(run_dir):
    lay = _fixture_run(run_dir)
    publish_record(lay.job("both").progress_json, "progress",
                   {"completed_iteration": 13, "stopped": "run.max_iterations (12) reached"}, run_id=RUN, generation=1)
    res = _wrapper("stop", "--log-path", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert ("is already finished (job both stopped after iteration 13: run.max_iterations (12) reached); "
            "nothing to stop") in res.stdout
    assert not lay.stop_file.exists()


def test_stop_twice_and_cancel_without_a_request_say_what_they_found(run_dir):
    lay = _fixture_run(run_dir)
    res = _wrapper("stop", "--log-path", str(run_dir), "--cancel")
    assert res.returncode == 0 and "no stop request" in res.stdout and "nothing to withdraw" in res.stdout
    assert "withdraw with: scripts/stop.sh --log-path" in _wrapper("stop", "--log-path", str(run_dir)).stdout
    first = lay.stop_file.read_bytes()
    assert "already in place" in _wrapper("stop", "--log-path", str(run_dir)).stdout
    assert lay.stop_file.read_bytes() == first
    assert "withdrawn" in _wrapper("stop", "--log-path", str(run_dir), "--cancel").stdout
    again = _wrapper("stop", "--log-path", str(run_dir), "--cancel")
    assert "no stop request" in again.stdout and "withdrawn" not in again.stdout


@pytest.mark.parametrize("name", ["status", "recover", "stop", "report"])
def test_every_wrapper_names_itself_in_help_and_usage_errors_exit_2(name):
    res = _wrapper(name, "--help")
    assert res.returncode == 0 and f"Usage: scripts/{name}.sh [OPTIONS]" in res.stdout, res.stdout
    assert "python -m coordination" not in res.stdout
    bad = _wrapper(name, "--no-such-flag")
    assert bad.returncode == 2 and f"scripts/{name}.sh" in bad.stderr and "No such option" in bad.stderr
