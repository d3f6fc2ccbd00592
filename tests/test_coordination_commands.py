"""status, recover and stop on real run folders."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from contextlib import contextmanager

import pytest

from coordination.clock import Clock, FakeClock
from coordination.heartbeat import KIND, HeartbeatWriter
from coordination.layout import RunLayout
from coordination.records import create_record, publish_record, read_record
from tests.procs import ROOT, bench_node, env

RUN = "run123"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordination", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=60)


class SkewedClock(Clock):
    """A heartbeat writer whose wall clock is `offset` seconds off this machine's."""

    def __init__(self, offset: float):
        self.offset = offset

    def wall(self) -> float:
        return time.time() + self.offset


TIMINGS = "coordination:\n  heartbeat_interval: 0.2\n  peer_timeout: 2.0\n"


@contextmanager
def _fixture_run(root: Path, live=(0, 1), skew: dict[int, float] | None = None):
    """A run with a master waiting at barrier 2 for rank 2, rank 1 waiting for GO, rank 2 silent.
    Ranks in `live` get a real HeartbeatWriter thread (its wall clock skewed by `skew[r]` s); the
    others one heartbeat written long ago by the writer's clock and never again."""
    lay = RunLayout(root)
    create_record(lay.run_json, "run", {"config_hash": "abc", "created_by": "a:1"}, run_id=RUN, generation=0)
    lay.config_yaml.write_text(TIMINGS)  # status and recover take the run's heartbeat timings from it
    job = lay.job("both")
    create_record(job.job_json, "job", {"num_nodes": 3, "rank_weights": [2, 1, 1]}, run_id=RUN, generation=0)
    now = time.time()
    beats = {
        0: dict(host="node-a", pid=101, iteration=4, phase=2, phase_name="train-rollout-done",
                message="waiting at barrier 2 train-rollout-done of iteration 4 for ranks [2]", waiting_for=[2]),
        1: dict(host="node-b", pid=202, iteration=4, phase=2, phase_name="train-rollout-done",
                message="waiting at barrier 2 for the master's GO"),
        2: dict(host="node-c", pid=303, iteration=4, phase=1, phase_name="train-rollout",
                message="rolling out 312/500 tasks"),
    }
    writers = []
    try:
        for r, d in beats.items():
            create_record(job.claim(r, 1), "claim", {"host": d["host"], "pid": d["pid"]}, run_id=RUN, generation=1)
            if r in live:
                w = HeartbeatWriter(job.heartbeat(r), run_id=RUN, generation=1, job="both", rank=r, interval=0.2,
                                    clock=SkewedClock((skew or {}).get(r, 0.0)))
                w.update(**d)
                writers.append(w.start())
            else:
                publish_record(job.heartbeat(r), KIND, dict(d, counter=5, nonce="x", state="running", wall=now),
                               run_id=RUN, generation=1)
        publish_record(lay.metrics(3), "metrics", {"train_reward_mean": 0.4, "eval_accuracy": 0.31}, run_id=RUN,
                       generation=0)
        yield lay, writers
    finally:
        for w in writers:
            w.stop()


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim"
    (v / "sub").mkdir(parents=True)
    (v / "keep.txt").write_bytes(b"not baton's")
    (v / "sub" / "data.bin").write_bytes(os.urandom(64))
    return v


def test_status_shows_live_and_silent_ranks_and_what_the_run_waits_for(run_dir):
    with _fixture_run(run_dir):
        res = _cli("status", "--log-path", str(run_dir), "--json")
        table = _cli("status", "--log-path", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert "watching heartbeats for up to 0.9 s" in res.stderr
    snap = json.loads(res.stdout)
    rows = {r["rank"]: r for r in snap["jobs"][0]["ranks"]}
    # One look of under a second cannot prove rank 2 dead: it is "not moving", not "lost".
    assert [rows[r]["state"] for r in (0, 1, 2)] == ["alive", "alive", "not moving"]
    assert rows[2]["host"] == "node-c" and rows[2]["phase"] == 1 and rows[2]["iteration"] == 4
    assert 0.5 <= rows[2]["heartbeat_age_s"] <= 5 and rows[0]["heartbeat_age_s"] < 0.9
    assert snap["jobs"][0]["waiting"] == ("barrier 2 train-rollout-done: waiting for rank 2 (host node-c), "
                                          "not moving, rolling out 312/500 tasks")
    assert snap["latest_metrics"]["eval_accuracy"] == 0.31
    assert table.returncode == 0
    for text in ("node-c", "not moving", "rolling out 312/500 tasks", "eval accuracy 0.310", "waiting for rank 2",
                 "watched for"):
        assert text in table.stdout, text


@pytest.mark.parametrize("skew", [-300.0, 300.0, 1e7])
def test_status_judges_liveness_on_its_own_clock_whatever_the_writers_wall_clock_says(run_dir, skew):
    """Observer 5 minutes ahead, behind, or a writer clock months off: the moving counter decides."""
    with _fixture_run(run_dir, live=(0, 1), skew={0: skew, 1: -skew}):
        res = _cli("status", "--log-path", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["rank"]: r for r in json.loads(res.stdout)["jobs"][0]["ranks"]}
    assert rows[0]["state"] == rows[1]["state"] == "alive"
    assert rows[0]["heartbeat_age_s"] < 5 and rows[1]["heartbeat_age_s"] < 5


def test_status_never_writes_to_the_log_path(run_dir):
    with _fixture_run(run_dir, live=()):
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
        assert _cli("status", "--log-path", str(run_dir)).returncode == 0
        after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    assert before == after


def test_status_on_a_folder_without_a_run_says_so(tmp_path):
    res = _cli("status", "--log-path", str(tmp_path))
    assert res.returncode == 1 and "no baton run" in res.stderr


def _leftovers(lay: RunLayout) -> tuple[Path, Path, Path]:
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
    return tmp, staging, done


def test_recover_lists_then_removes_only_leftovers(run_dir, tmp_path):
    victim = _victim(tmp_path)
    before = _tree(victim)
    with _fixture_run(run_dir) as (lay, writers):
        job = lay.job("both")
        tmp, staging, done = _leftovers(lay)
        dry = _cli("recover", "--log-path", str(run_dir))
        assert dry.returncode == 0, dry.stderr
        for p in (tmp, staging):
            assert str(p.relative_to(run_dir)) in dry.stdout
            assert p.exists(), "a dry run removed something"
        assert "iter-3" not in dry.stdout
        refused = _cli("recover", "--log-path", str(run_dir), "--apply")
        assert refused.returncode == 1 and "look alive" in refused.stderr and tmp.exists()
        for w in writers:  # stop the live nodes: their final heartbeat says they exited
            w.stop("exited")
        res = _cli("recover", "--log-path", str(run_dir), "--apply")
    assert res.returncode == 0, res.stderr
    assert "watching heartbeat counters" in res.stderr
    assert not tmp.exists() and not staging.exists()
    assert (done / "model.safetensors").read_bytes() == b"complete"
    assert job.claim(2, 1).exists(), "claim files are the fencing history and must stay"
    assert _tree(victim) == before


def test_recover_dry_run_while_nodes_live_names_what_apply_would_refuse_instead_of_inviting_it(run_dir):
    """The defect: a live training attempt's staging folder was listed as 'of an unfinished
    training attempt' with 'run again with --apply', which then refused."""
    with _fixture_run(run_dir) as (lay, writers):
        tmp, staging, _ = _leftovers(lay)
        mine = lay.job("both").node_dir(0) / ".heartbeat.json.tmp-node-a-101-beef"  # live rank 0's own
        mine.write_text("half")
        os.utime(mine, (time.time() - 3600, time.time() - 3600))
        before = _tree(run_dir)
        dry = _cli("recover", "--log-path", str(run_dir))
        after = _tree(run_dir)
        for w in writers:
            w.stop("exited")
        done = _cli("recover", "--log-path", str(run_dir))
    assert dry.returncode == 0, dry.stderr
    out = dry.stdout
    assert "run again with --apply" not in out, out
    lines = out.splitlines()

    def refusal_after(path: Path) -> str:
        i = next(n for n, ln in enumerate(lines) if str(path.relative_to(run_dir)) in ln)
        return lines[i + 1]

    said = refusal_after(staging)
    assert "--apply would refuse it now" in said and "rank 0 of job both (host node-a, pid 101)" in said, out
    assert "iteration 4" in said and "staging folder" in said, out
    assert "rank 0 of job both (host node-a, pid 101) is alive and may still be writing it" in refusal_after(mine), out
    assert "--apply would refuse it now: nodes of the run look alive" in refusal_after(tmp), out  # rank 2 is lost
    assert "--apply would refuse all of it while these nodes look alive" in out and "rank 1 of job both" in out, out
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed <= {f"jobs/both/nodes/rank-{r}/heartbeat.json" for r in (0, 1)}, changed
    assert done.returncode == 0 and "run again with --apply" in done.stdout and "refuse" not in done.stdout, done.stdout


@pytest.mark.parametrize("skew", [-300.0, 300.0])
def test_recover_apply_refuses_while_a_counter_moves_although_its_wall_time_is_minutes_off(run_dir, tmp_path, skew):
    """The defect: with the observer's clock 5 minutes ahead, the live master was called lost
    and its staging folder removed."""
    victim = _victim(tmp_path)
    before = _tree(victim)
    with _fixture_run(run_dir, live=(0,), skew={0: skew}) as (lay, _):
        _leftovers(lay)
        run_before = _tree(run_dir)
        res = _cli("recover", "--log-path", str(run_dir), "--apply")
        after = _tree(run_dir)
    assert res.returncode == 1 and "look alive" in res.stderr and "rank 0 of job both" in res.stderr
    changed = {k for k in set(run_before) | set(after) if run_before.get(k) != after.get(k)}
    assert changed <= {"jobs/both/nodes/rank-0/heartbeat.json"}, changed  # only the live writer's own beats
    assert _tree(victim) == before


def test_recover_calls_a_still_rank_dead_only_after_peer_timeout_of_its_own_clock(run_dir):
    from coordination.recover import plan

    with _fixture_run(run_dir, live=()) as (lay, _):
        job = lay.job("both")
        for r in (0, 1):  # these two said goodbye: judged at once, no waiting for them
            rec = read_record(job.heartbeat(r))
            publish_record(job.heartbeat(r), KIND, dict(rec.data, state="exited"), run_id=RUN, generation=1)
        clock = FakeClock()
        t0 = clock.monotonic()
        lines: list[str] = []
        items, _, snap = plan(run_dir, clock=clock, progress=lines.append)
    rows = {r["rank"]: r for r in snap["jobs"][0]["ranks"]}
    assert [rows[r]["state"] for r in (0, 1, 2)] == ["exited", "exited", "lost"]
    assert clock.monotonic() - t0 >= 2.0  # peer_timeout of the run's config.yaml, on the observer's clock
    assert clock.monotonic() - t0 < 3.0
    assert any("up to 2 s" in line for line in lines)


def test_recover_does_not_wait_for_ranks_that_said_they_exited(run_dir):
    from coordination.recover import plan

    with _fixture_run(run_dir, live=()) as (lay, _):
        job = lay.job("both")
        for r in (0, 1, 2):
            rec = read_record(job.heartbeat(r))
            publish_record(job.heartbeat(r), KIND, dict(rec.data, state="failed"), run_id=RUN, generation=1)
        clock = FakeClock()
        t0 = clock.monotonic()
        _, _, snap = plan(run_dir, clock=clock)
    assert {r["state"] for r in snap["jobs"][0]["ranks"]} == {"failed"}
    assert clock.monotonic() == t0


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


@pytest.mark.parametrize("spec", ["two:ten", "3", "3:99", "3:no-such-phase", "0:10", "3:10:1"])
def test_reset_phase_refuses_a_bad_spec_with_exit_2_and_the_valid_forms(run_dir, spec):
    with _fixture_run(run_dir, live=()):
        res = _cli("recover", "--log-path", str(run_dir), "--reset-phase", spec)
    assert res.returncode == 2, res.stderr
    assert "ITER:PHASE" in res.stderr and "10 train" in res.stderr and "Traceback" not in res.stderr


def test_reset_phase_accepts_a_phase_name_and_skips_folders_it_did_not_make(run_dir):
    """A folder of an unexpected name in sync/iter-N crashed recover with a ValueError."""
    from coordination.recover import plan

    with _fixture_run(run_dir, live=()) as (lay, _):
        sync = lay.job("both").sync_iter_dir(4)
        for name in ("02-train-rollout-done", "10-train", "10-train.a2", "notes", "x-10"):
            (sync / name).mkdir(parents=True)
        items, rollback, _ = plan(run_dir, "4:train", clock=FakeClock())
    names = sorted(i.path.name for i in items if i.path.parent == sync)
    assert names == ["10-train", "10-train.a2"] and rollback == {"both": 3}


def test_stop_command_writes_a_stop_request_and_cancel_withdraws_it(run_dir):
    with _fixture_run(run_dir, live=()) as (lay, _):
        pass
    res = _cli("stop", "--log-path", str(run_dir))
    assert res.returncode == 0 and lay.stop_file.exists()
    assert read_record(lay.stop_file, run_id=RUN).kind == "stop"
    assert _cli("stop", "--log-path", str(run_dir), "--cancel").returncode == 0
    assert not lay.stop_file.exists()


def _wrapper(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / f"{name}.sh"), *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=60)


def test_stop_on_a_finished_run_says_so_and_writes_nothing(run_dir):
    with _fixture_run(run_dir, live=()) as (lay, _):
        pass
    publish_record(lay.job("both").progress_json, "progress",
                   {"completed_iteration": 13, "stopped": "run.max_iterations (12) reached"}, run_id=RUN, generation=1)
    res = _wrapper("stop", "--log-path", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert ("is already finished (job both stopped after iteration 13: run.max_iterations (12) reached); "
            "nothing to stop") in res.stdout
    assert not lay.stop_file.exists()


def test_stop_twice_and_cancel_without_a_request_say_what_they_found(run_dir):
    with _fixture_run(run_dir, live=()) as (lay, _):
        pass
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


def _status_at(run_dir: Path, columns: int) -> str:
    """What `status` prints, its progress line on stderr first."""
    res = subprocess.run([sys.executable, "-m", "coordination", "status", "--log-path", str(run_dir)], cwd=ROOT,
                         env=env(COLUMNS=str(columns)), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stderr + res.stdout


def test_status_fits_80_columns_with_every_ranks_number_phase_and_state(run_dir):
    with _fixture_run(run_dir):
        narrow = _status_at(run_dir, 80)
        wide = _status_at(run_dir, 200)
    assert narrow.startswith("watching heartbeats") and max(len(line) for line in narrow.splitlines()) <= 80, narrow
    rows = [line for line in narrow.splitlines() if line.startswith("│")]
    expected = {0: ("2 train-rollout-done", "alive"), 1: ("2 train-rollout-done", "alive"),
                2: ("1 train-rollout", "not moving")}
    for rank, (phase, state) in expected.items():
        row = next((r for r in rows if r.split("│")[1].strip() == str(rank)), None)
        assert row is not None and phase in row and state in row and "node-" in row, narrow
    for msg in ("rank 2: rolling out 312/500 tasks", "rank 1: waiting at barrier 2 for the master's GO"):
        assert msg in narrow, narrow                  # messages moved under the table, whole
    header = next(line for line in wide.splitlines() if "rank" in line and "message" in line)
    assert all(col in header for col in ("host", "pid", "gen", "iter", "phase", "heartbeat", "state"))


def test_status_shows_the_last_train_reward_although_the_last_iteration_was_eval_only(run_dir):
    with _fixture_run(run_dir) as (lay, _):
        publish_record(lay.metrics(4), "metrics", {"eval_accuracy": 0.52, "policy_iteration": 3}, run_id=RUN,
                       generation=0)
        out = _status_at(run_dir, 120)
    assert "last train reward 0.400 (iteration 3), eval accuracy 0.520 (checkpoint 3, iteration 4)" in out


def test_status_watch_without_a_terminal_prints_a_plain_snapshot_every_interval(run_dir):
    with _fixture_run(run_dir):
        proc = subprocess.Popen([sys.executable, "-m", "coordination", "status", "--log-path", str(run_dir),
                                 "--watch", "--interval", "0.5"], cwd=ROOT, env=env(COLUMNS="100"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            time.sleep(3.0)
        finally:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate(timeout=10)
    assert out.count("job both: 3 nodes") >= 3, out
    assert out.count("next in 0.5 s") >= 3


@pytest.mark.parametrize("spec, says", [("3:10", "job both already ran iteration 4"),
                                        ("9:10", "iteration 9 has no flag folders")])
def test_reset_phase_of_an_old_or_unknown_iteration_exits_2_at_once_and_removes_nothing(run_dir, spec, says):
    with _fixture_run(run_dir, live=()) as (lay, _):
        for it in (3, 4):
            (lay.job("both").sync_iter_dir(it) / "10-train").mkdir(parents=True)
        before = _tree(run_dir)
        started = time.monotonic()
        res = _cli("recover", "--log-path", str(run_dir), "--reset-phase", spec, "--apply", "--peer-timeout", "30")
    assert res.returncode == 2 and says in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert time.monotonic() - started < 20      # refused before watching heartbeats for peer_timeout
    assert _tree(run_dir) == before
