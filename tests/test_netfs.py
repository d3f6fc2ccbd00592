"""The restart promises on a network filesystem (issue 16): two sshfs mounts of one folder over a
loopback sshd, once with sshfs's default caching and once with 20 s attribute and entry caches.
Each node's process uses its own mount as --log-path. Real runs of scripts/run.sh with the tiny
model; a node is killed in the middle of its work (a chunk written, the trainers met) and
restarted with the same command."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from coordination import exits
from coordination.layout import RunLayout
from coordination.records import publish_record, read_record
from tests.e2e import check_complete_run, kill_and_restart, node_cmd
from tests.netfs import CACHED_OPTIONS, SshfsPair, unavailable_reason
from tests.procs import wait_for_text
from tests.zombie import zombie_changes_nothing

pytestmark = pytest.mark.netfs

FLAGS = ("--rl-phase", "both", "--eval-interval", "0", "--num-nodes", "2", "--rank-weights", "1,1")
OVER = ("run.max_iterations=2",)
TASKS, GROUP = 24, 4  # tests.e2e.FAST


@pytest.fixture(scope="module", params=["default-cache", "cache-20s"])
def mounts(request, tmp_path_factory):
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    pair = SshfsPair(tmp_path_factory.mktemp(f"netfs-{request.param}"),
                     CACHED_OPTIONS if request.param == "cache-20s" else "")
    try:
        pair.start()  # a failure to set up is a test failure, not a skip
        yield pair
    finally:
        left = pair.stop()
        assert not left, f"netfs teardown: {left}"


class Run:
    """One run directory seen through both mounts; `local` is the folder behind them, read by the
    test so that its own observations do not warm either mount's caches."""

    def __init__(self, mounts: SshfsPair, name: str):
        self.local = mounts.share / name
        self.local.mkdir(mode=0o750)
        os.chmod(self.local, 0o750)
        self.via = tuple(m / name for m in mounts.mounts)
        self.layout = RunLayout(self.local)

    def cmd(self, assets, mount: int, *role: str, over: tuple[str, ...] = ()) -> list[str]:
        data, model = assets
        return node_cmd(data, model, self.via[mount], *FLAGS, *role, overrides=OVER + over)


def test_exclusive_creates_raced_through_two_mounts_have_one_winner_and_no_error(procs, mounts, tmp_path):
    """The loser of a true O_EXCL race on sshfs gets EPERM (docs/design.md §10.1); create_record
    must call that a lost race, as it does EEXIST, or a racing master dies with a traceback."""
    folder = mounts.share / "excl"
    folder.mkdir(mode=0o750)
    sync = tmp_path / "sync"
    sync.mkdir()
    count = 150
    for side, (me, other) in enumerate((("a", "b"), ("b", "a"))):
        procs.start(f"racer-{me}", [sys.executable, "-m", "tests.create_racer", str(mounts.mounts[side] / "excl"),
                                    str(sync), me, other, str(count)])
    outs = {}
    for me in ("a", "b"):
        assert procs.wait(f"racer-{me}", 120) == 0, procs.log(f"racer-{me}")[-2500:]
        outs[me] = json.loads(procs.log(f"racer-{me}").strip().splitlines()[-1])
    assert outs["a"]["errors"] == {} and outs["b"]["errors"] == {}, outs
    for i in range(count):
        winners = [me for me in ("a", "b") if i in outs[me]["won"]]
        losers = [me for me in ("a", "b") if i in outs[me]["lost"]]
        assert len(winners) == 1 and len(losers) == 1, (i, outs)
        assert read_record(folder / f"claim-{i}", kind="claim", run_id="race").data == {"by": winners[0]}
    print(f"netfs {mounts.options or 'default'}: {count} exclusive creates raced, a won {len(outs['a']['won'])}, "
          f"b won {len(outs['b']['won'])}")


# Trials of the race per cache setting: with 20 s caches the loser's mount can show run.json and
# job.json empty for longer than a fixed settle wait, which called a healthy run damaged in 4 of 15.
RACE_TRIALS = {"default-cache": 3, "cache-20s": 15}
LONG = ("run.max_iterations=1000",)


def _refused_naming(procs, name: str, holder: str) -> str:
    """Assert that `name` was refused at join (exit 3) naming the live holder `holder`, and never
    called the run damaged; returns its ERROR lines."""
    log = procs.log(name)
    assert procs.procs[name].returncode == exits.REFUSED, log[-2500:]
    assert "already held by a live process" in log and f"pid {procs.procs[holder].pid}" in log, log[-2500:]
    assert "damaged" not in log, log[-2500:]
    return "; ".join(ln for ln in log.splitlines() if "ERROR" in ln)


def test_racing_masters_and_a_duplicate_worker_are_refused_and_the_run_finishes(procs, mounts, assets):
    """Each trial: two masters on the two mounts race to create one run while its worker joins;
    the loser exits 3 naming the winner. A duplicate of the worker started on the other mount
    exits 3 naming the worker. The run is long enough to outlive the duplicate's join (a run that
    ended first would let the duplicate take the rank over); the first trial's run is then
    stopped with STOP and checked for exact counts, later ones are ended with SIGTERM."""
    trials = RACE_TRIALS["cache-20s" if mounts.options == CACHED_OPTIONS else "default-cache"]
    took, said, waited = [], [], 0
    for trial in range(trials):
        run = Run(mounts, f"race-{trial}")
        a, b, worker, dup = (f"{n}-{trial}" for n in ("master-a", "master-b", "worker", "worker-dup"))
        t0 = time.monotonic()
        procs.start(a, run.cmd(assets, 0, "--master", over=LONG))
        procs.start(b, run.cmd(assets, 1, "--master", over=LONG))
        procs.start(worker, run.cmd(assets, 1, "--worker", "1", over=LONG))
        deadline = time.monotonic() + 120
        while all(procs.procs[m].poll() is None for m in (a, b)):
            assert time.monotonic() < deadline, f"trial {trial}: neither racing master was refused within 120 s"
            time.sleep(0.1)
        loser = next(m for m in (a, b) if procs.procs[m].poll() is not None)
        winner = b if loser == a else a
        said.append(_refused_naming(procs, loser, winner))
        wait_for_text(procs, worker, "joined run", 120)
        procs.start(dup, run.cmd(assets, 0, "--worker", "1", over=LONG))
        procs.wait(dup, 120)
        said.append(_refused_naming(procs, dup, worker))
        took.append(time.monotonic() - t0)
        waited += any("not yet visible on this mount" in procs.log(n) for n in (loser, dup))
        if trial == 0:
            run_id = read_record(run.layout.run_json, kind="run").run_id
            publish_record(run.layout.stop_file, "stop", {"by": "test"}, run_id=run_id, generation=0)
            codes = {n: procs.wait(n, 500) for n in (winner, worker)}
            assert codes == {winner: 0, worker: 0}, {n: procs.log(n)[-2500:] for n in (winner, worker)}
            done = read_record(run.layout.job("both").progress_json, kind="progress").data["completed_iteration"]
            check_complete_run(run.layout, done, TASKS, GROUP, assets[1])
        else:
            for n in (winner, worker):
                procs.signal(n, signal.SIGTERM)
            for n in (winner, worker):
                procs.wait(n, 60)
        assert run.layout.job("both").claim_generations(0) == [1], f"trial {trial}"
        assert run.layout.job("both").claim_generations(1) == [1], f"trial {trial}"
    print(f"netfs {mounts.options or 'default'}: {trials} trials of racing masters + duplicate worker, each refused "
          f"with exit 3 naming the holder; in {waited} the loser or the duplicate waited for a record its mount "
          f"did not show yet; race to refusals {min(took):.1f}-{max(took):.1f} s; refusals: {said[:2]}")


def _kill_restart(procs, mounts, assets, name: str, rank: int, moment, over: tuple[str, ...] = (),
                  tasks: int = TASKS) -> Run:
    """Kill -9 rank `rank` once `moment(run)` says so (read through the local folder, so the
    test's own looks warm neither mount's cache) and restart it at once with the same command."""
    run = Run(mounts, name)
    t0 = time.monotonic()
    m_cmd, w_cmd = run.cmd(assets, 0, "--master", over=over), run.cmd(assets, 1, "--worker", "1", over=over)
    victim, cmd = ("worker", w_cmd) if rank == 1 else ("master", m_cmd)
    procs.start("master", m_cmd)
    procs.start("worker", w_cmd)
    kill_and_restart(procs, victim, cmd, lambda: moment(run))
    survivor = "worker" if rank == 0 else "master"
    codes = procs.wait_all(500)
    bad = {n: procs.log(n)[-2500:] for n in (survivor, f"{victim}-again") if codes[n] != 0}
    assert not bad, bad
    check_complete_run(run.layout, 2, tasks, GROUP, assets[1])
    assert run.layout.job("both").claim_generations(rank) == [1, 2], "the restart did not take the rank over"
    print(f"netfs {mounts.options or 'default'}: {victim} killed, run done {time.monotonic() - t0:.1f} s")
    return run


def test_worker_killed_mid_rollout_rejoins_with_the_same_command(procs, mounts, assets):
    """Killed once its first chunk of iteration 1 is in place: the restart keeps that chunk."""
    def first_chunk_written(run: Run) -> bool:
        chunks = run.layout.rollout_rank_dir("train", 1, 1)
        return chunks.exists() and any(p.suffix == ".parquet" for p in chunks.iterdir())

    over = ("tasks.tasks_per_iteration=160", "rollout.prompts_per_call=2", "rollout.chunk_groups=2")
    run = _kill_restart(procs, mounts, assets, "kill-worker", 1, first_chunk_written, over, tasks=160)
    done = read_record(run.layout.rollout_done("train", 1, 1)).data
    assert any(c["name"].endswith("-g1.parquet") for c in done["chunks"]), "the restarted rank redid everything"


def test_master_killed_mid_training_resumes_with_the_same_command(procs, mounts, assets):
    """Killed once its trainer trains iteration 1 (its state record says so, written as phase 10's
    order starts; the trainers launched at phase 0 have loaded during the rollouts, so a loaded
    trainer is not yet a training one): the attempt fails on both nodes and the restarted master's
    GO asks for attempt 2."""
    from coordination.records import try_read
    from train.resident import STATE_KIND

    def training(run: Run) -> bool:
        rec = try_read(run.layout.job("both").trainer_state(0, 0), kind=STATE_KIND)
        return rec is not None and rec.data["state"] == "training" and rec.data.get("iteration") == 1

    run = _kill_restart(procs, mounts, assets, "kill-master", 0, training)
    assert (run.layout.training_dir(1) / "attempt-2").exists(), "the interrupted training attempt was not retried"


def test_fenced_zombie_changes_no_file_through_either_mount_after_it_wakes(procs, mounts):
    # The zombie and the master use one mount, the replacement the other, so the zombie learns of
    # the newer claim through its own mount's caches.
    local = mounts.share / "zombie"
    local.mkdir(mode=0o750)
    via = tuple(m / "zombie" for m in mounts.mounts)
    zombie_changes_nothing(procs, local, (via[0], via[0], via[1]))
