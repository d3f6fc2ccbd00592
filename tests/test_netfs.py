"""The restart promises on a network filesystem (issue 16): two sshfs mounts of one folder over a
loopback sshd, once with sshfs's default caching and once with 20 s attribute and entry caches.
Each node's process uses its own mount as --log-path. Real runs of scripts/run.sh with the tiny
model; a node is killed in the middle of its work (a chunk written, the trainers met) and
restarted with the same command."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

from coordination import exits
from coordination.layout import RunLayout
from coordination.records import read_record
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


def _finish(procs, names: list[str], run: Run, assets, timeout: float = 500) -> None:
    codes = procs.wait_all(timeout)
    bad = {n: procs.log(n)[-2500:] for n in names if codes[n] != 0}
    assert not bad, bad
    check_complete_run(run.layout, 2, TASKS, GROUP, assets[1])


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


def test_racing_masters_and_a_duplicate_worker_are_refused_and_the_run_finishes(procs, mounts, assets):
    run = Run(mounts, "race")
    t0 = time.monotonic()
    procs.start("master-a", run.cmd(assets, 0, "--master"))
    procs.start("master-b", run.cmd(assets, 1, "--master"))
    procs.start("worker", run.cmd(assets, 1, "--worker", "1"))
    deadline = time.monotonic() + 120
    while all(procs.procs[m].poll() is None for m in ("master-a", "master-b")):
        assert time.monotonic() < deadline, "neither racing master was refused within 120 s"
        time.sleep(0.1)
    loser = next(m for m in ("master-a", "master-b") if procs.procs[m].poll() is not None)
    winner = "master-b" if loser == "master-a" else "master-a"
    assert procs.procs[loser].returncode == exits.REFUSED, procs.log(loser)[-2500:]
    assert "already held by a live process" in procs.log(loser), procs.log(loser)[-2500:]
    wait_for_text(procs, "worker", "joined run", 120)
    procs.start("worker-dup", run.cmd(assets, 0, "--worker", "1"))
    assert procs.wait("worker-dup", 120) == exits.REFUSED, procs.log("worker-dup")[-2500:]
    dup = procs.log("worker-dup")
    assert "already held by a live process" in dup and f"pid {procs.procs['worker'].pid}" in dup, dup[-2500:]
    _finish(procs, [winner, "worker"], run, assets)
    assert run.layout.job("both").claim_generations(0) == [1]
    assert run.layout.job("both").claim_generations(1) == [1]
    said = [ln for n in (loser, "worker-dup") for ln in procs.log(n).splitlines() if "ERROR" in ln]
    print(f"netfs {mounts.options or 'default'}: racing masters + duplicate worker run {time.monotonic() - t0:.1f} s; "
          f"refusals: {said}")


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
