"""Rank takeover on generations (docs/design.md §5 rule 7), on a filesystem that behaves like NFS
or sshfs: rename flags refused with EINVAL, negative lookups cached. Fake clock for the waits;
real processes for the holders that die and for the races."""
from __future__ import annotations

import builtins
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordination import records
from coordination.claims import ClaimRefused, RankClaim, machine, process_start
from coordination.clock import FakeClock
from coordination.config import CoordinationConfig
from coordination.heartbeat import KIND as HB_KIND
from coordination.layout import RunLayout
from coordination.records import create_record, publish_record, read_record
from tests.procs import ROOT, env

RUN = "r"
CFG = CoordinationConfig(heartbeat_interval=1, peer_timeout=4, rejoin_timeout=30)


class NetworkFs:
    """What this process sees through a network filesystem mount, in-process:
    - `renameat2` with flags fails with EINVAL (sshfs, the Linux NFS client), for any code that
      tries an exchange (filelock's stale-lease break does);
    - names in `negative` are cached as absent: stat, open and directory listings miss them,
      while an O_EXCL create of one still fails with EEXIST (the server decides)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.negative: set[str] = set()
        self.exchanges_refused = 0
        real_exists, real_listdir, real_open = os.path.exists, os.listdir, builtins.open

        def refuse_exchange(*_a, **_k):
            self.exchanges_refused += 1
            raise OSError(errno.EINVAL, "Invalid argument (rename flags refused by the filesystem)")

        for mod in ("filelock._util", "filelock._soft"):  # where an exchange would come from
            m = pytest.importorskip(mod)
            if hasattr(m, "exchange_names"):
                monkeypatch.setattr(m, "exchange_names", refuse_exchange)

        def exists(p):
            return str(p) not in self.negative and real_exists(p)

        def listdir(p="."):
            return [n for n in real_listdir(p) if str(Path(p) / n) not in self.negative]

        def open_(p, *a, **k):
            if str(p) in self.negative:
                raise FileNotFoundError(errno.ENOENT, "cached negative lookup", str(p))
            return real_open(p, *a, **k)

        monkeypatch.setattr(os.path, "exists", exists)
        monkeypatch.setattr(os, "listdir", listdir)
        monkeypatch.setattr(records, "open", open_, raising=False)

    def hide(self, path: Path) -> None:
        self.negative.add(str(path))


@pytest.fixture
def netfs(monkeypatch) -> NetworkFs:
    return NetworkFs(monkeypatch)


def _claim(job, gen: int, **data) -> None:
    assert create_record(job.claim(1, gen), "claim", data, run_id=RUN, generation=gen)


def _beat(job, gen: int, counter: int, host: str = "other-host", pid: int = 4242, state: str = "running") -> None:
    publish_record(job.heartbeat(1), HB_KIND, {"nonce": "n", "counter": counter, "host": host, "pid": pid,
                                               "iteration": 1, "phase": 1, "phase_name": "train-rollout",
                                               "message": "rolling out", "state": state},
                   run_id=RUN, generation=gen, durable=False)


class LiveRemoteClock(FakeClock):
    """A fake clock under which a holder on another host keeps beating every second."""

    def __init__(self, job, gen: int):
        super().__init__()
        self.job, self.gen, self.counter, self.next_beat = job, gen, 1, self.monotonic() + 1

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.monotonic() >= self.next_beat:
            self.counter += 1
            _beat(self.job, self.gen, self.counter)
            self.next_beat += 1


def _holder_process(run_dir: Path, rank: int = 1) -> subprocess.Popen:
    """A real process that takes `rank` (claim + heartbeat) and prints its generation."""
    code = ("import signal\nfrom coordination.config import CoordinationConfig\n"
            "from coordination.layout import RunLayout\nfrom coordination.node import Node\n"
            f"cfg = CoordinationConfig(heartbeat_interval=1, peer_timeout=4, rejoin_timeout=30)\n"
            f"n = Node.join(RunLayout({str(run_dir)!r}), 'both', {rank}, 2, run_id={RUN!r}, cfg=cfg)\n"
            "print('held', n.generation, flush=True)\nsignal.pause()\n")  # holds the rank until the test kills it
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline().split() == ["held", "1"]
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    return p


def test_restarted_rank_on_the_same_host_takes_over_at_once_when_the_old_pid_is_gone(tmp_path, netfs):
    lay = RunLayout(tmp_path)
    job = lay.job("both")
    old = _holder_process(tmp_path)
    os.killpg(old.pid, signal.SIGKILL)
    old.wait()
    clock = FakeClock()
    start = clock.monotonic()
    gen = RankClaim(job, 1, run_id=RUN, cfg=CFG, clock=clock).acquire()
    assert gen == 2 and clock.monotonic() - start < 1.0, "waited although the holder's pid was gone"
    assert read_record(job.claim(1, 2)).data["pid"] == os.getpid()


def test_a_recycled_pid_does_not_keep_a_dead_holder_alive(tmp_path, netfs):
    job = RunLayout(tmp_path).job("both")
    # The claim names a pid that is alive now (this test process) but started at another time.
    _claim(job, 1, **machine(), pid=os.getpid(), pid_start=str(int(process_start(os.getpid())) - 100))
    clock = FakeClock()
    assert RankClaim(job, 1, run_id=RUN, cfg=CFG, clock=clock).acquire() == 2
    assert clock.monotonic() == FakeClock().monotonic()


def test_holder_on_another_host_is_taken_over_only_after_peer_timeout_without_a_counter_change(tmp_path, netfs):
    job = RunLayout(tmp_path).job("both")
    _claim(job, 1, host="other-host", boot_id="b", pid_ns="ns", pid=4242, pid_start="77")
    _beat(job, 1, counter=9)
    clock = FakeClock()
    start = clock.monotonic()
    gen = RankClaim(job, 1, run_id=RUN, cfg=CFG, clock=clock).acquire()
    waited = clock.monotonic() - start
    assert gen == 2 and CFG.peer_timeout < waited <= CFG.peer_timeout + 1.0, waited


def test_holder_whose_heartbeat_moves_is_refused_naming_host_and_pid(tmp_path, netfs):
    job = RunLayout(tmp_path).job("both")
    _claim(job, 1, host="other-host", boot_id="b", pid_ns="ns", pid=4242, pid_start="77")
    _beat(job, 1, counter=1)
    clock = LiveRemoteClock(job, 1)
    with pytest.raises(ClaimRefused, match="host other-host pid 4242"):
        RankClaim(job, 1, run_id=RUN, cfg=CFG, clock=clock).acquire()
    assert not job.claim(1, 2).exists()
    assert clock.monotonic() - FakeClock().monotonic() <= 2 * CFG.heartbeat_interval


def test_live_process_on_the_same_host_is_refused(tmp_path, netfs):
    job = RunLayout(tmp_path).job("both")
    holder = _holder_process(tmp_path)
    try:
        with pytest.raises(ClaimRefused, match=f"pid {holder.pid}"):
            RankClaim(job, 1, run_id=RUN, cfg=CFG).acquire()  # real clock: the holder really beats
        assert job.claim_generations(1) == [1]
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


def test_newer_claim_hidden_by_a_cached_negative_lookup_is_found_by_o_excl_and_not_taken_over(tmp_path, netfs):
    job = RunLayout(tmp_path).job("both")
    _claim(job, 1, **machine(), pid=999_999_999, pid_start="1")  # dead, this machine
    _claim(job, 2, host="other-host", boot_id="b", pid_ns="ns", pid=4242, pid_start="77")  # live, elsewhere
    _beat(job, 2, counter=1)
    netfs.hide(job.claim(1, 2))  # this mount still believes claim-2 does not exist
    assert job.claim_generations(1) == [1]
    with pytest.raises(ClaimRefused, match="other-host pid 4242"):
        RankClaim(job, 1, run_id=RUN, cfg=CFG, clock=LiveRemoteClock(job, 2)).acquire()
    assert sorted(p.name for p in job.node_dir(1).glob("claim-*")) == ["claim-1", "claim-2"]


def test_holder_learns_it_is_fenced_even_while_the_new_claim_is_hidden_from_it(tmp_path, netfs):
    job = RunLayout(tmp_path).job("both")
    mine = RankClaim(job, 1, run_id=RUN, cfg=CFG, clock=FakeClock())
    assert mine.acquire() == 1 and not mine.is_fenced()
    _claim(job, 2, host="other-host", boot_id="b", pid_ns="ns", pid=4242, pid_start="77")
    netfs.hide(job.claim(1, 2))
    assert not mine.is_fenced()  # nothing readable yet says so
    _beat(job, 2, counter=1)  # the successor's heartbeat is a read of content: no negative cache
    assert mine.is_fenced() and mine.is_fenced(probe=False)


def test_holder_that_said_goodbye_is_taken_over_at_once_from_another_host(tmp_path, netfs):
    job = RunLayout(tmp_path).job("both")
    _claim(job, 1, host="other-host", boot_id="b", pid_ns="ns", pid=4242, pid_start="77")
    _beat(job, 1, counter=30, state="exited")
    clock = FakeClock()
    assert RankClaim(job, 1, run_id=RUN, cfg=CFG, clock=clock).acquire() == 2
    assert clock.monotonic() == FakeClock().monotonic()


def _race(tmp_path: Path, n: int) -> list[dict]:
    go = tmp_path / "go"
    ps = [subprocess.Popen([sys.executable, "-m", "tests.claim_contender", str(tmp_path / "run"), "1", str(go), "3"],
                           cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True, start_new_session=True)
          for _ in range(n)]
    try:
        time.sleep(2.0)  # every contender imported and polls GO
        go.write_text("go")
        outs = [json.loads(p.stdout.readline()) for p in ps]
        for p in ps:
            p.wait(timeout=30)
        return outs
    finally:
        for p in ps:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.parametrize("stale_holder", [False, True], ids=["fresh-rank", "dead-holder"])
def test_racing_contenders_yield_exactly_one_holder(tmp_path, stale_holder):
    job = RunLayout(tmp_path / "run").job("both")
    if stale_holder:  # everyone sees claim-1 of a dead pid here and races for claim-2 at once
        job.node_dir(1).mkdir(parents=True)
        _claim(job, 1, **machine(), pid=999_999_999, pid_start="1")
    outs = _race(tmp_path, 4)
    winners = [o for o in outs if "generation" in o]
    want = 2 if stale_holder else 1
    assert len(winners) == 1 and winners[0]["generation"] == want, outs
    for o in outs:
        if o is not winners[0]:
            assert f"pid {winners[0]['pid']}" in o["refused"], o
    assert job.claim_generations(1) == list(range(1, want + 1))
