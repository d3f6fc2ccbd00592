"""The fence guard: once a newer generation's claim exists, no writer of this process puts
anything under the log path (docs/design.md §5 rule 7). Real files; the claim is made by hand."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from coordination import log as blog, timeline
from coordination.clock import FakeClock
from coordination.heartbeat import HeartbeatWriter, LivenessTracker
from coordination.records import (ENV_FENCE, Fenced, FenceGuard, atomic_output, create_record, install_fence,
                                  fence_check, is_temp_name, publish_bytes)
from tests.procs import ROOT, env


@pytest.fixture
def fenced_dir(tmp_path: Path):
    """A folder with one published file and a guard whose newer claim does not exist yet."""
    d = tmp_path / "run"
    d.mkdir()
    publish_bytes(d / "chunk", b"old")
    newer = d / "claim-2"
    install_fence(FenceGuard(newer))
    return d, newer


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_every_writer_refuses_once_the_newer_claim_exists_and_leaves_no_file(fenced_dir):
    d, newer = fenced_dir
    publish_bytes(d / "chunk", b"new")  # not fenced yet: writes go through
    newer.write_bytes(b"claim of generation 2")
    with pytest.raises(Fenced):
        fence_check()  # noticed: from here no writer creates even a temp file
    before = _files(d)
    with pytest.raises(Fenced):
        publish_bytes(d / "chunk", b"zombie")
    with pytest.raises(Fenced):
        with atomic_output(d / "table") as tmp:
            tmp.write_bytes(b"zombie parquet")
    with pytest.raises(Fenced):
        create_record(d / "go", "go", {}, run_id="r", generation=1)
    with pytest.raises(Fenced):
        timeline.append(d / "timeline.jsonl", {"event": "end"})
    assert _files(d) == before  # no target changed, no temp file left behind


def test_in_flight_write_is_neither_renamed_into_place_nor_removed_when_the_claim_appears_meanwhile(fenced_dir):
    # Removing its temp file would be a change under the log path by a superseded process: the
    # file stays, named as a temp file, for `recover` to list and remove.
    d, newer = fenced_dir
    with pytest.raises(Fenced):
        with atomic_output(d / "chunk") as tmp:
            tmp.write_bytes(b"written before the pause")
            newer.write_bytes(b"taken over while this process was paused")
    left = _files(d)
    temps = [name for name in left if is_temp_name(name)]
    assert len(temps) == 1 and left.pop(temps[0]) == b"written before the pause"
    assert left == {"chunk": b"old", "claim-2": b"taken over while this process was paused"}


def test_child_of_a_fenced_node_inherits_the_guard_through_the_environment(fenced_dir):
    d, newer = fenced_dir
    newer.write_bytes(b"claim")
    code = ("import sys; from pathlib import Path; from coordination.records import publish_bytes, Fenced\n"
            "try:\n    publish_bytes(Path(sys.argv[1]), b'child')\nexcept Fenced:\n    sys.exit(5)\n")
    import os
    p = subprocess.run([sys.executable, "-c", code, str(d / "chunk")], cwd=ROOT,
                       env=env(**{ENV_FENCE: os.environ[ENV_FENCE]}), capture_output=True, timeout=60)
    assert p.returncode == 5, p.stderr.decode()
    assert (d / "chunk").read_bytes() == b"old"


def test_rank_log_file_stays_untouched_once_the_fence_is_noticed(fenced_dir, tmp_path):
    d, newer = fenced_dir
    log_file = tmp_path / "driver.log"
    root = logging.getLogger("baton")
    saved = (list(root.handlers), root.propagate, root.level)
    logger = blog.setup("test rank1", log_file)
    try:
        logger.error("before the takeover")
        newer.write_bytes(b"claim")
        with pytest.raises(Fenced):
            publish_bytes(d / "chunk", b"zombie")  # the fence is noticed here
        size = log_file.stat().st_size
        logger.error("rank 1 generation 1 was taken over; this process stops")
        assert log_file.stat().st_size == size
        assert "before the takeover" in log_file.read_text()
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in saved[0]:
            root.addHandler(h)
        root.propagate, root.level = saved[1], saved[2]


def test_a_new_phase_is_in_the_heartbeat_file_when_update_returns(tmp_path: Path):
    hb = tmp_path / "hb.json"
    w = HeartbeatWriter(hb, run_id="r", generation=1, job="both", rank=1, interval=30).start()
    try:
        w.update(message="phase 13 iteration-done", iteration=1, phase=13)
        w.update(message="phase 0 sync", iteration=2, phase=0)  # a kill right now must show this
        rec = LivenessTracker(10, FakeClock()).read(hb, 1, run_id="r").record
        assert (rec.data["iteration"], rec.data["phase"]) == (2, 0)
    finally:
        w.stop()


def test_watcher_names_a_silent_peer_but_not_one_that_said_goodbye(tmp_path: Path):
    from coordination.config import CoordinationConfig
    from coordination.heartbeat import PeerView
    from coordination.layout import RunLayout
    from coordination.node import Node
    from coordination.records import Record

    lay = RunLayout(tmp_path)
    node = Node(lay, lay.job("both"), "r", 0, 3, CoordinationConfig(), generation=1)
    rec = Record("heartbeat", "r", 1, {"state": "exited", "host": "h", "pid": 1}, 0.0, Path("x"))
    gone = PeerView(1, rec, 0.0, 0.0, 200.0, lost=True, exited=True)
    assert not node._judge(gone, "busy", exits=False)      # the watcher: a clean exit is no loss
    assert node._judge(gone, "waiting for barrier 2")      # a wait that needs it: it is gone
    silent = PeerView(2, None, 0.0, 0.0, 200.0, lost=True, exited=False)
    assert node._judge(silent, "busy", exits=False) and node._announced == {1, 2}
