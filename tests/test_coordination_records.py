"""Atomic records, validated reads, layout and config machinery."""
from __future__ import annotations

import errno
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordination.clock import Backoff, FakeClock
from coordination.config import ConfigError, CoordinationConfig, load, option, section
from coordination.layout import RunLayout, barrier_name, chunk_identity
from coordination.records import (BrokenRecord, NotThereYet, PatientReader, WrongRun, create_record,
                                  is_temp_name, publish_record, read_or_none, read_record, try_read)


def test_published_record_reads_back_with_envelope(tmp_path: Path):
    p = tmp_path / "a" / "rec.json"
    publish_record(p, "arrival", {"ok": True, "n": 3}, run_id="r1", generation=2)
    rec = read_record(p, kind="arrival", run_id="r1")
    assert rec.data == {"ok": True, "n": 3} and rec.generation == 2 and rec.run_id == "r1"
    assert not [n for n in os.listdir(p.parent) if is_temp_name(n)], "temp files left behind"
    assert oct(p.stat().st_mode & 0o777) == oct(0o640)


def test_truncated_record_is_not_there_yet(tmp_path: Path):
    p = tmp_path / "rec.json"
    publish_record(p, "go", {"decision": "continue"}, run_id="r", generation=1)
    raw = p.read_bytes()
    for cut in (0, 1, len(raw) // 2, len(raw) - 3):
        p.write_bytes(raw[:cut])
        with pytest.raises(NotThereYet):
            read_record(p)


def test_altered_record_fails_its_checksum(tmp_path: Path):
    p = tmp_path / "rec.json"
    publish_record(p, "go", {"decision": "continue"}, run_id="r", generation=1)
    env = json.loads(p.read_text())
    env["data"]["decision"] = "abort"
    p.write_text(json.dumps(env))
    with pytest.raises(NotThereYet, match="checksum"):
        read_record(p)


def test_record_of_another_run_is_not_mistaken_for_this_run(tmp_path: Path):
    p = tmp_path / "rec.json"
    publish_record(p, "arrival", {"ok": True}, run_id="old-run", generation=1)
    with pytest.raises(WrongRun, match="old-run"):
        read_record(p, run_id="new-run")


def test_read_or_none_gives_only_a_whole_record_of_this_run_where_try_read_still_refuses_another_run(tmp_path):
    p = tmp_path / "rec.json"
    assert read_or_none(p, run_id="r") is None                                    # missing
    publish_record(p, "go", {"decision": "continue"}, run_id="r", generation=3)
    raw = p.read_bytes()
    assert read_or_none(p, kind="go", run_id="r").data == {"decision": "continue"}
    assert read_or_none(p, kind="arrival", run_id="r") is None                    # another kind
    p.write_bytes(raw[:len(raw) // 2])
    assert read_or_none(p, run_id="r") is None                                    # half written
    p.write_bytes(raw)
    assert read_or_none(p, run_id="other") is None                                # another run's
    with pytest.raises(WrongRun):
        try_read(p, run_id="other")


def test_garbage_record_is_retried_then_reported_as_broken(tmp_path: Path):
    clock = FakeClock()
    reader = PatientReader(broken_after=10.0, clock=clock.monotonic)
    p = tmp_path / "rec.json"
    assert reader.read(p) is None  # missing: simply not there yet, never broken
    clock.advance(100)
    assert reader.read(p) is None
    p.write_bytes(b"\x00garbage{")
    assert reader.read(p) is None
    clock.advance(5)
    assert reader.read(p) is None
    clock.advance(6)
    with pytest.raises(BrokenRecord, match="rec.json") as broken:
        reader.read(p)
    assert "scripts/recover.sh --reset-phase ITER:PHASE" in str(broken.value)   # the command that removes one
    publish_record(p, "k", {"x": 1}, run_id="r", generation=1)  # repaired: readable again
    assert reader.read(p).data == {"x": 1}


def test_exclusive_create_happens_once(tmp_path: Path):
    p = tmp_path / "GO"
    assert create_record(p, "go", {"decision": "continue"}, run_id="r", generation=1)
    assert not create_record(p, "go", {"decision": "abort"}, run_id="r", generation=2)
    assert read_record(p).data["decision"] == "continue"


def test_exclusive_create_that_loses_a_race_with_eperm_returns_false_and_a_real_eperm_raises(tmp_path, monkeypatch):
    """sshfs reports the loser of a true O_EXCL race as EPERM (the netfs tier races it for real):
    a fake winner creates the name during our open, so EPERM with the name there is a lost race."""
    real_open = os.open
    target = tmp_path / "claim-1"

    def open_after_the_winner(path, flags, *mode_and_dir):
        if Path(path) == target and flags & os.O_EXCL:
            target.write_bytes(b"the winner's record")
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_open(path, flags, *mode_and_dir)

    monkeypatch.setattr(os, "open", open_after_the_winner)
    assert create_record(target, "claim", {"by": "me"}, run_id="r", generation=1) is False
    assert target.read_bytes() == b"the winner's record"

    def refused(path, flags, *mode_and_dir):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(PermissionError):
        create_record(tmp_path / "claim-2", "claim", {"by": "me"}, run_id="r", generation=1)
    monkeypatch.setattr(os, "open", real_open)
    assert not (tmp_path / "claim-2").exists()


def test_backoff_grows_from_20ms_to_1s():
    b = Backoff(0.02, 1.0, 1.25)
    delays = [b.next() for _ in range(40)]
    assert delays[0] == 0.02 and delays[-1] == 1.0
    assert all(x <= y for x, y in zip(delays, delays[1:]))
    # at most 50 probes per second of waiting by construction
    assert all(d >= 0.02 for d in delays)


def test_layout_names_are_scoped_and_parseable(tmp_path: Path):
    lay = RunLayout(tmp_path)
    job = lay.job("both")
    assert job.arrival(3, 2, "train-rollout-done", 1).relative_to(tmp_path).as_posix() == \
        "jobs/both/sync/iter-3/02-train-rollout-done/rank-1"
    assert barrier_name(10, "train", 2) == "10-train.a2"
    assert chunk_identity(lay.rollout_chunk("train", 1, 0, 7, 3).name) == (7, 3)
    with pytest.raises(ValueError, match="job must be one of"):
        lay.job("nope")


def test_layout_lists_the_files_it_names_and_nothing_else_in_their_folders(tmp_path: Path):
    lay = RunLayout(tmp_path)
    assert lay.training_result_ranks(2, 1) == [] and lay.config_change_count() == 0 and lay.timeline_files() == []
    for rank in (10, 2, 0):
        publish_record(lay.training_result(2, 1, rank), "result", {}, run_id="r", generation=0)
    (lay.training_attempt_dir(2, 1) / "result-rank-x.json").write_text("{}")
    (lay.training_attempt_dir(2, 1) / "notes.txt").write_text("")
    assert lay.training_result_ranks(2, 1) == [0, 2, 10]
    for n in (1, 2):
        publish_record(lay.config_change(n), "config-change", {}, run_id="r", generation=0)
    (lay.config_changes_dir / "change-draft.json").write_text("{}")
    assert lay.config_change_count() == 2
    lines = [lay.job("both").timeline(1), lay.job("eval").timeline(0), lay.job("both").trainer_timeline(0)]
    for path in lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    assert lay.timeline_files() == sorted(lines[:2]) and lay.trainer_timeline_files() == [lines[2]]
    # Two processes' retention renaming the same checkpoint away never pick one name.
    assert lay.checkpoint_trash(4, 77) != lay.checkpoint_trash(4, 78)
    assert lay.checkpoint_trash(4, 77).parent == lay.checkpoint_trash_dir


@dataclass
class _Inner:
    lr: float = option(1e-3, "learning rate")
    steps: int = option(4, "steps")

    def __post_init__(self):
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1 (got {self.steps})")


@dataclass
class _Outer:
    train: _Inner = section(_Inner, "training")
    name: str = option("x", "a name")


def test_overrides_apply_and_unknown_keys_name_the_closest(tmp_path: Path):
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  lr: 0.5\n")
    cfg = load(_Outer, [y], ["train.steps=7", "name=run1"])
    assert cfg.train.lr == 0.5 and cfg.train.steps == 7 and cfg.name == "run1"
    with pytest.raises(ConfigError, match="did you mean train.steps"):
        load(_Outer, [], ["train.stepz=3"])
    with pytest.raises(ConfigError, match="train.lr must be a number"):
        load(_Outer, [], ["train.lr=fast"])
    with pytest.raises(ConfigError, match="train.steps must be at least 1"):
        load(_Outer, [], ["train.steps=0"])


def test_coordination_config_rejects_peer_timeout_shorter_than_two_beats():
    with pytest.raises(ConfigError, match="peer_timeout"):
        CoordinationConfig(heartbeat_interval=5, peer_timeout=8)


def test_a_temp_file_names_the_host_and_pid_that_made_it_even_when_the_host_has_dashes():
    from coordination.records import _temp_name, temp_writer

    made = _temp_name(Path("/run/jobs/both/nodes/rank-1/heartbeat.json")).name
    assert temp_writer(made) == (socket.gethostname(), os.getpid())
    assert temp_writer(".all.parquet.tmp-gpu-node-07-4242-ab12cd34") == ("gpu-node-07", 4242)
    assert temp_writer("all.parquet") is None and temp_writer(".x.tmp-host-notapid-ab12") is None
