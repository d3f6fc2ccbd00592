"""Records another node has just created, read through a mount whose attribute cache shows them
stale: the wait is the config's bound, not a fixed 10 s, and a record still unreadable at its end
is "not yet visible on this mount", never "damaged" unless its bytes cannot be a record.

The stale mount is faked the only way a local disk allows: the file exists empty (what sshfs and
NFS show until their cache expires) and its content lands when the fake clock passes the cache
timeout. Real files; only the clock is fake."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from coordination.clock import FakeClock
from coordination.config import CoordinationConfig, redact
from coordination.join import join_job
from coordination.layout import RunLayout
from coordination.manifest import JoinRefused, _hash_of, ensure_job, join_run_as_worker, open_run_as_master
from coordination.records import encode_record

CFG = {"train": {"lr": 0.001, "steps": 4}, "logging": {"tensorboard": False}}
FACTS = {"rank_weights": [1, 1], "num_nodes": 2}
RUN_ID = "abcdef012345"
CACHE = 25.0  # longer than the fixed 10 s the join used to wait


class StaleMount(FakeClock):
    """Shows `path` as it is (empty) until the clock passes `cache` seconds, then its content."""

    def __init__(self, path: Path, content: bytes, cache: float = CACHE):
        super().__init__()
        self.path, self.content = path, content
        self.reveal_at = self.monotonic() + cache
        self.slept = 0.0

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        self.slept += seconds
        if self.monotonic() >= self.reveal_at and self.path.read_bytes() != self.content:
            self.path.write_bytes(self.content)


def _run(root: Path, *, run_json: bytes | None = None, config: dict = CFG) -> RunLayout:
    lay = RunLayout(root)
    lay.run_json.write_bytes(encode_record("run", {"config_hash": _hash_of(config), "created_by": "h:1"},
                                           run_id=RUN_ID, generation=0) if run_json is None else run_json)
    lay.config_yaml.write_text(yaml.safe_dump(redact(config), sort_keys=False))
    return lay


def _record(kind: str, data: dict) -> bytes:
    return encode_record(kind, data, run_id=RUN_ID, generation=0)



def _config_shown_after_the_cache(lay):
    """A FakeClock class under which the run's config.yaml is missing until CACHE seconds passed
    (a mount whose entry cache hides it)."""
    content = lay.config_yaml.read_bytes()
    lay.config_yaml.unlink()

    class LateConfig(FakeClock):
        def sleep(self, seconds: float) -> None:
            super().sleep(seconds)
            if self.monotonic() >= 1000 + CACHE and not lay.config_yaml.exists():
                lay.config_yaml.write_bytes(content)

    return LateConfig

def test_a_master_waits_for_a_run_json_its_mount_shows_empty_longer_than_ten_seconds(run_dir):
    lay = _run(run_dir, run_json=b"")
    clock = StaleMount(lay.run_json, _record("run", {"config_hash": _hash_of(CFG), "created_by": "h:1"}))
    info = open_run_as_master(lay, CFG, resume=False, settle=60, clock=clock)
    assert info.run_id == RUN_ID
    assert CACHE <= clock.slept < CACHE + 1


def test_a_job_json_shown_empty_longer_than_ten_seconds_is_waited_for_by_default(run_dir):
    lay = _run(run_dir)
    job = lay.job("both")
    job.job_json.parent.mkdir(parents=True)
    job.job_json.write_bytes(b"")
    clock = StaleMount(job.job_json, _record("job", FACTS))
    assert ensure_job(job, RUN_ID, FACTS, master=True, clock=clock) == FACTS
    assert CACHE <= clock.slept < CACHE + 1


@pytest.mark.parametrize("shown", [b"", b"\0" * 300, b'{\n "crc": 12'], ids=["empty", "zeros", "cut-off"])
def test_a_job_json_still_unreadable_after_the_configured_bound_is_not_yet_visible_never_damaged(run_dir, shown):
    """join_job takes the bound from coordination.broken_record_timeout."""
    lay = _run(run_dir)
    job = lay.job("both")
    job.job_json.parent.mkdir(parents=True)
    job.job_json.write_bytes(shown)
    clock = StaleMount(job.job_json, _record("job", FACTS), cache=1e9)
    cfg = CoordinationConfig(broken_record_timeout=30)
    with pytest.raises(JoinRefused) as err:
        join_job(lay, job="both", rank=0, num_nodes=2, job_facts={"rank_weights": [1, 1]}, config=CFG, cfg=cfg,
                 clock=clock)
    msg = str(err.value)
    assert "not yet visible on this mount (attribute cache) after 30 s" in msg, msg
    assert "damaged" not in msg and "new --log-path" not in msg, msg
    assert 30 <= clock.slept < 31
    assert job.job_json.read_bytes() == shown, "the join changed the record it could not read"
    assert not job.node_dir(0).exists(), "a node that could not read job.json claimed a rank"


@pytest.mark.parametrize("shown", [b'{"num_nodes": 2}\n', b"num_nodes: 2\n", b'[1, 2]'],
                         ids=["json-not-a-record", "yaml", "json-list"])
def test_a_job_json_whose_bytes_cannot_be_a_record_is_damaged_at_once(run_dir, shown):
    lay = _run(run_dir)
    job = lay.job("both")
    job.job_json.parent.mkdir(parents=True)
    job.job_json.write_bytes(shown)
    clock = FakeClock()
    t0 = clock.monotonic()
    with pytest.raises(JoinRefused, match=r"job\.json is damaged.*cannot be a baton job record.*new --log-path"):
        ensure_job(job, RUN_ID, FACTS, master=True, clock=clock)
    assert clock.monotonic() == t0, "no cache expiry turns these bytes into a record: nothing to wait for"
    assert job.job_json.read_bytes() == shown


def test_a_run_json_that_is_not_a_baton_record_is_refused_as_such_at_once(run_dir):
    lay = _run(run_dir, run_json=b'{"results": [1, 2, 3]}\n')
    clock = FakeClock()
    t0 = clock.monotonic()
    with pytest.raises(JoinRefused, match=r"run\.json is damaged.*not a baton run.*empty --log-path"):
        open_run_as_master(lay, CFG, resume=False, clock=clock)
    assert clock.monotonic() == t0


def test_a_worker_says_at_once_that_run_json_is_not_visible_yet_and_joins_when_it_shows(run_dir, caplog):
    """A duplicate worker on a mount that cached run.json empty used to wait silently."""
    lay = _run(run_dir, run_json=b"")
    clock = StaleMount(lay.run_json, _record("run", {"config_hash": _hash_of(CFG), "created_by": "h:1"}))
    with caplog.at_level(logging.INFO, logger="baton.settle"):
        info = join_run_as_worker(lay, CFG, join_timeout=600, clock=clock, settle=60)
    assert info.run_id == RUN_ID
    said = [r for r in caplog.records if "not yet visible on this mount" in r.getMessage()]
    assert len(said) == 1 and str(lay.run_json) in said[0].getMessage(), caplog.text
    assert CACHE <= clock.slept < CACHE + 1


def test_a_worker_gives_up_on_an_invisible_run_json_after_the_settle_bound_not_the_join_timeout(run_dir):
    lay = _run(run_dir, run_json=b"")
    clock = StaleMount(lay.run_json, b"", cache=1e9)
    with pytest.raises(JoinRefused, match=r"not yet visible on this mount \(attribute cache\) after 40 s"):
        join_run_as_worker(lay, CFG, join_timeout=600, clock=clock, settle=40)
    assert 40 <= clock.slept < 41


def test_a_master_with_another_config_is_told_the_configs_differ_when_config_yaml_shows_late(run_dir):
    """config.yaml hidden by a mount's entry cache for 25 s: the old 10 s wait called the run
    damaged and told the user to throw it away."""
    other = dict(CFG, train={"lr": 0.002, "steps": 4})
    lay = _run(run_dir)
    LateConfig = _config_shown_after_the_cache(lay)

    with pytest.raises(JoinRefused, match=r"(?s)config differs.*train.lr: 0.001 -> 0.002") as err:
        open_run_as_master(lay, other, resume=False, settle=60, clock=LateConfig())
    assert "damaged" not in str(err.value)


def test_a_config_yaml_that_never_shows_is_not_yet_visible_and_names_the_hash_that_restores_it(run_dir):
    other = dict(CFG, train={"lr": 0.002, "steps": 4})
    lay = _run(run_dir)
    lay.config_yaml.unlink()
    with pytest.raises(JoinRefused) as err:
        open_run_as_master(lay, other, resume=False, settle=60, clock=FakeClock())
    msg = str(err.value)
    assert "not yet visible on this mount (attribute cache) after 60 s" in msg and _hash_of(CFG) in msg, msg
    assert "damaged" not in msg and not lay.config_yaml.exists()


@pytest.mark.parametrize("shown", [b"- a\n- list\n", b"train: [unclosed\n"], ids=["list", "not-yaml"])
def test_a_config_yaml_that_is_not_a_mapping_is_damaged_at_once_and_left_as_it_is(run_dir, shown):
    lay = _run(run_dir)
    lay.config_yaml.write_bytes(shown)
    clock = FakeClock()
    t0 = clock.monotonic()
    with pytest.raises(JoinRefused, match=rf"config\.yaml is damaged.*hash {_hash_of(CFG)}"):
        join_run_as_worker(lay, CFG, join_timeout=600, clock=clock, settle=60)
    assert clock.monotonic() == t0 and lay.config_yaml.read_bytes() == shown


def test_a_master_whose_lookup_missed_a_run_json_that_the_listing_shows_joins_that_run(run_dir, monkeypatch):
    """Between this master's lookup of run.json (none: or a mount's cached "not found") and its
    listing of the folder, the other master created run.json, config.yaml and jobs/: that is a run
    being born, not a folder of foreign files."""
    import coordination.manifest as manifest

    lay = RunLayout(run_dir)
    listing = manifest._foreign_entries

    def other_master_wins_meanwhile(layout):
        if not lay.run_json.exists():
            _run(run_dir)
            lay.job("both").job_json.parent.mkdir(parents=True)
        return listing(layout)

    monkeypatch.setattr(manifest, "_foreign_entries", other_master_wins_meanwhile)
    info = open_run_as_master(lay, CFG, resume=False, settle=60, clock=FakeClock())
    assert info.run_id == RUN_ID


def test_a_folder_with_a_foreign_run_json_is_still_refused_as_no_baton_run(run_dir):
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "run.json").write_text('{"epochs": 3}\n')
    with pytest.raises(JoinRefused, match=r"run\.json is damaged.*not a baton run.*empty --log-path"):
        open_run_as_master(RunLayout(run_dir), CFG, resume=False, clock=FakeClock())
    assert (run_dir / "run.json").read_text() == '{"epochs": 3}\n'


def test_a_worker_that_finds_run_json_but_no_config_yaml_says_so_at_once_and_joins_when_it_shows(run_dir, caplog):
    lay = _run(run_dir)
    LateConfig = _config_shown_after_the_cache(lay)

    with caplog.at_level(logging.INFO, logger="baton.manifest"):
        info = join_run_as_worker(lay, CFG, join_timeout=600, clock=LateConfig(), settle=60)
    assert info.run_id == RUN_ID
    said = [r.getMessage() for r in caplog.records if "config.yaml is not visible on this mount yet" in r.getMessage()]
    assert len(said) == 1 and RUN_ID in said[0], caplog.text
