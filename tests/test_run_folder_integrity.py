"""Nothing outside the run folder is written, read as baton's own or deleted through a link planted
in it; nothing of another run is adopted; nothing baton creates is wider than 0o750 / 0o640
(issue 13 defects 1, 2, 3 and 7). Every test ends by checking that a victim folder outside the run
is byte-for-byte what it was."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordination import timeline
from coordination.layout import LinkInRunFolder, RunLayout
from coordination.records import (atomic_output, create_record, ensure_dir, publish_record, read_record,
                                  remove_tree)
from tests.procs import ROOT, env

RUN = "run-b"


def tree_state(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder`: type, mode and (for files) SHA-256 of the bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            out[str(p.relative_to(folder))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), digest)
    return out


@pytest.fixture
def victim(tmp_path: Path):
    """A folder outside the run that looks like run folders' contents (so a careless listing
    would take its names for baton's), and an assertion that it is unchanged at the end."""
    v = tmp_path / "victim"
    for rel, data in {"precious.txt": b"keep me", "iter-1.a1/model.safetensors": b"w" * 64,
                      "iter-2.a1/config.json": b"{}", "10-train/rank-0": b"another run's arrival",
                      "rank-0/chunk-00000-g1.parquet": b"not ours", "driver.log": b"their log\n"}.items():
        (v / rel).parent.mkdir(parents=True, exist_ok=True)
        (v / rel).write_bytes(data)
    before = tree_state(v)
    yield v
    assert tree_state(v) == before, "a folder outside the run was changed through a planted link"


def _run(root: Path) -> RunLayout:
    lay = RunLayout(root)
    create_record(lay.run_json, "run", {"config_hash": "abc", "created_by": "t:1"}, run_id=RUN, generation=0)
    return lay


def _plant(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


# -- defect 1: recover --------------------------------------------------------------------------

def _recover(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordination", "recover", "--log-path", str(run), *args],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)


def test_recover_apply_refuses_a_linked_staging_folder_and_deletes_nothing_through_it(tmp_path, victim):
    lay = _run(tmp_path / "run")
    _plant(lay.checkpoint_staging_dir, victim)
    res = _recover(lay.root, "--apply")
    assert res.returncode == 1, res.stdout + res.stderr
    assert str(lay.checkpoint_staging_dir) in res.stderr and "symbolic link" in res.stderr, res.stderr


def test_recover_reset_phase_refuses_a_linked_iteration_flag_folder(tmp_path, victim):
    lay = _run(tmp_path / "run")
    _plant(lay.job("both").sync_iter_dir(3), victim)
    res = _recover(lay.root, "--reset-phase", "3:10", "--apply")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "symbolic link" in res.stderr, res.stderr


def test_recover_removes_only_staging_folders_named_by_baton(tmp_path):
    lay = _run(tmp_path / "run")
    ours = ensure_dir(lay.checkpoint_staging(4, 1))
    (ours / "model.safetensors").write_bytes(b"partial")
    foreign = ensure_dir(lay.checkpoint_staging_dir / "notes")
    (foreign / "readme").write_text("the user's")
    res = _recover(lay.root, "--apply")
    assert res.returncode == 0, res.stderr
    assert not ours.exists() and (foreign / "readme").read_text() == "the user's"


# -- defect 2: retention and every writer ---------------------------------------------------------

def _checkpoint(lay: RunLayout, iteration: int, run_id: str = RUN) -> Path:
    from coordination.checkpoints import mark_complete
    from tests.ckpt_support import stamped_file

    folder = ensure_dir(lay.checkpoint_staging(iteration, 1))
    stamped_file(folder / "model.safetensors", run_id, iteration, 10 + iteration)
    mark_complete(folder, iteration=iteration, run_id=run_id)
    return folder


def test_retention_never_deletes_the_entries_of_a_linked_staging_folder(tmp_path, victim):
    from coordination.checkpoints import apply_retention, publish_checkpoint

    lay = _run(tmp_path / "run")
    for it in (1, 2, 3):
        publish_checkpoint(lay, it, _checkpoint(lay, it), run_id=RUN)
    remove_tree(lay.checkpoint_staging_dir)
    _plant(lay.checkpoint_staging_dir, victim)
    with pytest.raises(LinkInRunFolder, match=r"\.staging"):
        apply_retention(lay, keep_last=1, protected=set())


def _write_arrival(lay: RunLayout) -> None:
    publish_record(lay.job("both").arrival(3, 10, "train", 0), "arrival", {"ok": True}, run_id=RUN, generation=1)


def _create_go(lay: RunLayout) -> None:
    create_record(lay.job("both").go(3, 10, "train"), "go", {"decision": "continue"}, run_id=RUN, generation=1)


def _write_chunk(lay: RunLayout) -> None:
    from rollout import store
    from rollout.chunks import write_chunk

    row = dict(task_id="t", sample_index=0, prompt="p", prompt_ids=[1], completion_ids=[2], logprobs=[-0.1],
               text="x", reward=1.0, finish_reason="stop", policy_iteration=0, iteration=3, split="train", rank=0,
               generation=1, **store.one_turn(1))
    write_chunk(lay.rollout_chunk("train", 3, 0, 0, 1), [row], run_id=RUN, generation=1)


def _write_plan(lay: RunLayout) -> None:
    publish_record(lay.training_plan(3), "training-plan", {"steps": []}, run_id=RUN, generation=1)


def _write_shard(lay: RunLayout) -> None:
    from train.batches import write_shard

    write_shard(lay.training_shard(3, 0), [])


def _write_metrics(lay: RunLayout) -> None:
    publish_record(lay.metrics(3), "metrics", {"loss": 1.0}, run_id=RUN, generation=0)


def _append_timeline(lay: RunLayout) -> None:
    timeline.append(lay.job("both").timeline(0), {"event": "start", "phase": 10})


def _log_line(lay: RunLayout) -> None:
    from coordination import log

    try:
        log.setup("rank0 master", lay.job("both").log_file(0, "driver"))
        logging.getLogger("baton.test").info("a line that must not land outside the run")
    finally:
        log.setup("test")


def _prepare_staging(lay: RunLayout) -> None:
    import torch

    from train.distributed import DistInfo
    from train.export import prepare_output_dir

    prepare_output_dir(lay.checkpoint_staging(1, 1), DistInfo(rank=0, world_size=1, local_rank=0,
                                                               device=torch.device("cpu")))


def _child_log(lay: RunLayout) -> None:
    from coordination.records import open_own

    with open_own(lay.job("both").log_file(0, "trainer"), "ab") as fh:
        fh.write(b"trainer output\n")


# (what is linked, relative to the run folder; the link's target inside the victim; the writer)
WRITERS = {
    "barrier arrival": ("jobs/both/sync/iter-3", ".", _write_arrival),
    "barrier GO": ("jobs/both/sync/iter-3/10-train", "10-train", _create_go),
    "rollout chunk": ("rollouts/train/iter-3", ".", _write_chunk),
    "training plan": ("training/iter-3", ".", _write_plan),
    "training shard": ("training", ".", _write_shard),
    "metrics": ("metrics", ".", _write_metrics),
    "timeline file": ("timeline/both-rank-0.jsonl", "precious.txt", _append_timeline),
    "driver.log": ("logs/both/rank-0/driver.log", "driver.log", _log_line),
    "child log": ("logs/both/rank-0", ".", _child_log),
    "checkpoint staging": ("checkpoints/.staging", ".", _prepare_staging),
}


@pytest.mark.parametrize("what", sorted(WRITERS))
def test_no_writer_writes_or_deletes_through_a_planted_link(tmp_path, victim, what):
    rel, target, write = WRITERS[what]
    lay = _run(tmp_path / "run")
    _plant(lay.root / rel, (victim / target).resolve())
    with pytest.raises(LinkInRunFolder, match="symbolic link"):
        write(lay)


def _append_trainer_timeline(lay: RunLayout) -> None:
    timeline.append(lay.job("both").trainer_timeline(0), {"event": "training", "wall": 1.0})


def _append_log(component: str):
    def write(lay: RunLayout) -> None:
        from coordination.records import open_own

        with open_own(lay.job("both").log_file(0, component), "ab") as fh:  # how the driver hands a child its log
            fh.write(b"child output\n")
    return write


def _overwrite_in_place(lay: RunLayout) -> None:
    from coordination.records import open_own

    with open_own(lay.job("both").log_file(0, "driver"), "wb") as fh:
        fh.write(b"")


# (the name baton appends to or overwrites, relative to the run folder; the victim file it is a
# second name of; the writer). Every file baton appends to is here.
APPENDED = {
    "timeline file": ("timeline/both-rank-0.jsonl", "precious.txt", _append_timeline),
    "trainer timeline": ("timeline/trainer/both-rank-0.jsonl", "precious.txt", _append_trainer_timeline),
    "driver.log": ("logs/both/rank-0/driver.log", "driver.log", _log_line),
    "trainer.log": ("logs/both/rank-0/trainer.log", "driver.log", _append_log("trainer")),
    "inference.log": ("logs/both/rank-0/inference.log", "driver.log", _append_log("inference")),
    "overwrite in place": ("logs/both/rank-0/driver.log", "driver.log", _overwrite_in_place),
}


@pytest.mark.parametrize("what", sorted(APPENDED))
def test_no_writer_appends_to_or_overwrites_a_hard_link(tmp_path, victim, what):
    """A second name of a file outside the run (same filesystem): appending or truncating through
    it would change the victim although no symbolic link is on the way."""
    rel, target, write = APPENDED[what]
    lay = _run(tmp_path / "run")
    (lay.root / rel).parent.mkdir(parents=True, exist_ok=True)
    os.link(victim / target, lay.root / rel)
    with pytest.raises(LinkInRunFolder, match=r"is a hard link \(one file with 2 names\).*rm "):
        write(lay)


def test_a_file_baton_made_itself_is_appended_to_and_overwritten_as_before(tmp_path):
    lay = _run(tmp_path / "run")
    for _ in range(2):
        _append_timeline(lay)
        _append_log("trainer")(lay)
    assert len(lay.job("both").timeline(0).read_bytes().splitlines()) == 2
    assert lay.job("both").log_file(0, "trainer").read_bytes() == b"child output\n" * 2
    _append_log("driver")(lay)
    _overwrite_in_place(lay)
    assert lay.job("both").log_file(0, "driver").read_bytes() == b""


def test_a_record_that_is_a_link_is_not_read_as_ours(tmp_path, victim):
    lay = _run(tmp_path / "run")
    other = _run(tmp_path / "other-run")
    go = other.job("both").go(3, 10, "train")
    create_record(go, "go", {"decision": "abort"}, run_id=RUN, generation=1)  # even a same-id lookalike
    _plant(lay.job("both").go(3, 10, "train"), go)
    with pytest.raises(LinkInRunFolder):
        read_record(lay.job("both").go(3, 10, "train"))


def test_links_above_the_run_folder_are_the_users_choice(tmp_path):
    real = ensure_dir(tmp_path / "disk" / "runs")
    _plant(tmp_path / "runs", real)
    lay = _run(tmp_path / "runs" / "run")
    _write_arrival(lay)
    assert read_record(lay.job("both").arrival(3, 10, "train", 0)).data == {"ok": True}


def test_barrier_polling_checks_each_folder_once(tmp_path, monkeypatch):
    from coordination.records import try_read

    lay = _run(tmp_path / "run")
    calls = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: calls.append(p) or real_lstat(p, *a, **k))
    go = lay.job("both").go(3, 10, "train")
    for _ in range(100):  # waiting for a GO whose folder does not exist yet: only the open
        assert try_read(go) is None
    assert calls == []
    _write_arrival(lay)  # creates the barrier folder: its folders are checked once here
    path = lay.job("both").arrival(3, 10, "train", 0)
    read_record(path)
    calls.clear()
    for _ in range(100):
        read_record(path)
        _write_arrival(lay)
        assert try_read(go) is None
    assert calls == [], "a verified folder was checked again"


# -- defect 3: nothing of another run is adopted ------------------------------------------------------

@pytest.mark.parametrize("how", ["copied", "linked"])
def test_another_runs_checkpoint_is_refused_naming_both_run_ids(tmp_path, how):
    import shutil

    from coordination.checkpoints import CheckpointError, is_complete, publish_checkpoint, read_latest

    other = RunLayout(tmp_path / "other-run")
    publish_checkpoint(other, 2, _checkpoint(other, 2, run_id="run-a"), run_id="run-a")
    lay = _run(tmp_path / "run")
    publish_checkpoint(lay, 1, _checkpoint(lay, 1), run_id=RUN)
    if how == "copied":
        shutil.copytree(other.checkpoint(2), lay.checkpoint(2))
        expected = CheckpointError
    else:
        _plant(lay.checkpoint(2), other.checkpoint(2))
        expected = LinkInRunFolder
    other_state = tree_state(other.root)
    with pytest.raises(expected) as err:
        is_complete(lay.checkpoint(2), run_id=RUN)  # the driver's and trainer's "already published?"
    if how == "copied":
        assert "run-a" in str(err.value) and RUN in str(err.value)
    with pytest.raises(expected):
        publish_checkpoint(lay, 2, lay.checkpoint_staging(2, 1), run_id=RUN)
    assert read_latest(lay, run_id=RUN) == (1, lay.checkpoint(1)), "LATEST moved to another run's checkpoint"
    assert tree_state(other.root) == other_state


def test_a_barrier_record_of_another_run_is_an_error_at_once(tmp_path):
    from coordination.records import PatientReader, WrongRun

    lay = _run(tmp_path / "run")
    create_record(lay.job("both").go(3, 10, "train"), "go", {"decision": "continue"}, run_id="run-a", generation=1)
    with pytest.raises(WrongRun, match="run-a.*run-b"):
        PatientReader(broken_after=60).read(lay.job("both").go(3, 10, "train"), kind="go", run_id=RUN)


# -- defect 7: permissions whatever the umask -----------------------------------------------------------

def _too_wide(folder: Path) -> list[str]:
    bad = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = stat.S_IMODE(p.lstat().st_mode)
            limit = 0o750 if p.is_dir() else 0o640
            if mode & ~limit:
                bad.append(f"{p.relative_to(folder)} {oct(mode)}")
    return bad


@pytest.fixture
def umask_000():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_folders_and_files_baton_writes_are_private_under_umask_000(tmp_path, umask_000):
    from rollout import store

    lay = RunLayout(tmp_path / "run")
    publish_record(lay.job("both").arrival(3, 10, "train", 0), "arrival", {}, run_id=RUN, generation=1)
    create_record(lay.job("both").claim(0, 1), "claim", {}, run_id=RUN, generation=1)
    timeline.append(lay.job("both").timeline(0), {"event": "x"})
    _write_chunk(lay)
    with atomic_output(lay.rollout_stats("train", 3)) as tmp:
        tmp.write_text("{}")
    assert _too_wide(tmp_path) == []
    assert store.read_rows(lay.rollout_chunk("train", 3, 0, 0, 1))[0]["task_id"] == "t"


def test_an_entrypoint_under_umask_000_writes_nothing_world_accessible(tmp_path, umask_000):
    """train.tiny writes through Hugging Face save_pretrained, which never chmods: the umask the
    entrypoint sets is what keeps its files private."""
    out = tmp_path / "models" / "tiny"
    res = subprocess.run([sys.executable, "-m", "train.tiny", "--out", str(out), "--layers", "1"], cwd=ROOT,
                         env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (out / "config.json").exists()
    assert _too_wide(out) == []


# -- the same promises on a real run (scripts/run.sh, tiny model, torchrun) ----------------------------

@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tests.e2e import make_assets

    return make_assets(tmp_path_factory.mktemp("e2e-assets"))


def _start(procs, name: str, assets, log: Path) -> None:
    from tests.e2e import node_cmd

    data, model = assets
    procs.start(name, node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "0",
                               overrides=("run.max_iterations=2",)))


def _stopped_after_iteration_1(procs, assets, log: Path) -> RunLayout:
    """A one-node run of 2 iterations, killed as soon as LATEST names checkpoint 1; a restart
    with the same command continues with iteration 2."""
    import signal
    import time

    from coordination.records import try_read

    _start(procs, "first", assets, log)
    lay = RunLayout(log)
    deadline = time.monotonic() + 300
    while (rec := try_read(lay.latest)) is None or rec.data["iteration"] < 1:
        assert procs.procs["first"].poll() is None, procs.log("first")[-3000:]
        assert time.monotonic() < deadline, "iteration 1 did not publish in 300 s"
        time.sleep(0.02)
    procs.signal("first", signal.SIGKILL)
    procs.wait("first", 30)
    assert not (lay.checkpoint(2)).exists(), "the node got to iteration 2's publication before it was killed"
    return lay


@pytest.mark.slow
def test_a_run_under_umask_000_then_restarted_with_a_linked_staging_folder(procs, tmp_path, assets, victim,
                                                                           umask_000):
    """The run's files stay private although the user's umask is 000; the restart stops with a
    message naming the planted link instead of training into (and deleting from) its target."""
    from tests.e2e import fresh_log

    lay = _stopped_after_iteration_1(procs, assets, fresh_log(tmp_path))
    assert _too_wide(lay.root) == []
    remove_tree(lay.checkpoint_staging_dir)
    _plant(lay.checkpoint_staging_dir, victim)
    _start(procs, "restart", assets, lay.root)
    assert procs.wait_all(400)["restart"] != 0, procs.log("restart")[-3000:]
    assert f"{lay.checkpoint_staging_dir} is a symbolic link" in procs.log("restart")
    assert read_record(lay.latest).data["iteration"] == 1


@pytest.mark.slow
def test_a_restart_of_a_cp_al_copy_of_a_run_changes_nothing_of_the_original(procs, tmp_path, assets):
    """`cp -al runA runB` makes every file of runB a second name of one of runA's. A restart of
    runB with runA's command stops at the first file it would append to, with one line naming it
    (exit 3, as for a symbolic link), and runA is byte for byte what it was."""
    from tests.e2e import fresh_log

    lay = _stopped_after_iteration_1(procs, assets, fresh_log(tmp_path))
    # The killed node's torchrun (a process group of its own) ends on the parent-death signal and
    # still writes its last words to trainer.log: the original is final only once it is gone.
    driver_log = lay.job("both").log_file(0, "driver").read_text()
    procs.adopt([int(pid) for pid in re.findall(r"torchrun pid (\d+)", driver_log)])
    deadline = time.monotonic() + 60
    while procs.alive_groups():
        assert time.monotonic() < deadline, f"the killed node's trainers still run: groups {procs.alive_groups()}"
        time.sleep(0.1)
    before = tree_state(lay.root)
    copy = tmp_path / "copy-of-run"
    subprocess.run(["cp", "-al", str(lay.root), str(copy)], check=True, timeout=60)
    _start(procs, "restart", assets, copy)
    assert procs.wait("restart", 120) == 3, procs.log("restart")[-3000:]
    out = procs.log("restart")
    assert "is a hard link (one file with 2 names)" in out and "Traceback" not in out, out[-3000:]
    assert tree_state(lay.root) == before


@pytest.mark.slow
def test_a_checkpoint_of_another_run_in_checkpoints_is_never_adopted(procs, tmp_path, assets):
    """checkpoints/iter-2 holds a complete checkpoint whose marker names another run: the restarted
    run stops naming both run ids; it neither skips training as "already published" nor moves LATEST."""
    import shutil

    from tests.e2e import fresh_log
    from coordination.checkpoints import list_files, mark_complete

    lay = _stopped_after_iteration_1(procs, assets, fresh_log(tmp_path))
    ours = read_record(lay.run_json).run_id
    foreign = tmp_path / "other-run-iter-2"
    shutil.copytree(lay.checkpoint(1), foreign)
    (foreign / "baton-complete.json").unlink()
    mark_complete(foreign, iteration=2, run_id="run-from-elsewhere")
    assert list_files(foreign)
    shutil.copytree(foreign, lay.checkpoint(2))
    _start(procs, "restart", assets, lay.root)
    assert procs.wait_all(400)["restart"] != 0, procs.log("restart")[-3000:]
    out = procs.log("restart")
    assert "run-from-elsewhere" in out and ours in out, out[-3000:]
    assert read_record(lay.latest).data["iteration"] == 1
    assert not (lay.metrics(2)).exists()


@pytest.mark.slow
def test_a_same_size_copy_of_another_runs_weights_in_a_published_checkpoint_stops_the_restart(procs, tmp_path,
                                                                                              assets):
    """checkpoints/iter-1/model.safetensors is replaced by another run's weights of the same size
    (the same file with another run id of the same length in its metadata, as a second run of this
    config would write it); the marker's sizes all match. The restarted node stops naming the file
    and both runs instead of sampling from or training on them, and LATEST stays at 1."""
    from tests.e2e import fresh_log

    lay = _stopped_after_iteration_1(procs, assets, fresh_log(tmp_path))
    ours = read_record(lay.run_json).run_id
    weights = lay.checkpoint(1) / "model.safetensors"
    data = weights.read_bytes()
    other = "f" * len(ours)
    assert data.count(f'"{ours}"'.encode()) == 1
    weights.unlink()
    weights.write_bytes(data.replace(f'"{ours}"'.encode(), f'"{other}"'.encode()))
    assert weights.stat().st_size == len(data)
    _start(procs, "restart", assets, lay.root)
    assert procs.wait_all(400)["restart"] != 0, procs.log("restart")[-3000:]
    out = procs.log("restart")
    assert f"{weights} belongs to run {other}, iteration 1, but the checkpoint that lists it is run {ours}, " \
           f"iteration 1" in out, out[-3000:]
    assert read_record(lay.latest).data["iteration"] == 1
    assert not lay.checkpoint(2).exists() and not lay.metrics(2).exists()


def test_training_data_is_never_prepared_from_another_runs_trajectories(tmp_path):
    from rollout import store
    from train.config import TrainConfig
    from train.data import TrainingDataError, prepare_training_data

    lay = _run(tmp_path / "run")
    row = dict(task_id="t", sample_index=0, prompt="p", prompt_ids=[1, 5], completion_ids=[6, 2],
               logprobs=[-0.5, -0.5], text="x", reward=1.0, finish_reason="stop", policy_iteration=0, iteration=1,
               split="train", rank=0, generation=1, **store.one_turn(2))
    store.write_rows(lay.rollout_all("train", 1), [row, dict(row, sample_index=1, reward=0.0)], run_id="run-a")
    with pytest.raises(TrainingDataError, match="belongs to run run-a, not to this run run-b"):
        prepare_training_data(lay, 1, TrainConfig(micro_batch_tokens=64), run_id=RUN, world_size=1,
                              temperature=1.0, input_checkpoint=tmp_path / "base", input_iteration=0)
    assert not lay.training_plan(1).exists()


def test_the_trainer_refuses_a_plan_of_another_run(tmp_path):
    lay = _run(tmp_path / "run")
    publish_record(lay.training_plan(2), "training-plan", {"steps": [], "world_size": 1}, run_id="run-a",
                   generation=1)
    res = subprocess.run([sys.executable, "-m", "train.trainer", "--plan", str(lay.training_plan(2))], cwd=ROOT,
                         env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "belongs to run run-a, not to this run run-b" in res.stderr, res.stderr
    assert not lay.checkpoint(2).exists() and not lay.latest.exists()


@pytest.mark.slow
def test_a_node_restarted_with_a_linked_driver_log_is_refused_with_one_message(procs, tmp_path, assets, victim):
    """The first file a node opens for itself: exit 3 (refused), the message names the link, and
    the log it points at gets not a byte."""
    import signal

    from tests.e2e import fresh_log
    from tests.procs import wait_for_text

    log = fresh_log(tmp_path)
    _start(procs, "first", assets, log)
    wait_for_text(procs, "first", "logs of this rank", 120)
    procs.signal("first", signal.SIGKILL)
    procs.wait("first", 30)
    driver_log = RunLayout(log).job("both").log_file(0, "driver")
    driver_log.unlink()
    _plant(driver_log, victim / "driver.log")
    _start(procs, "restart", assets, log)
    assert procs.wait("restart", 120) == 3, procs.log("restart")[-3000:]
    out = procs.log("restart")
    assert "driver.log is a symbolic link" in out and "Traceback" not in out, out[-3000:]


def test_report_replaces_a_planted_link_instead_of_writing_through_it(tmp_path, victim):
    from coordination.report import make_report

    lay = _run(tmp_path / "run")
    _write_metrics(lay)
    _plant(lay.report_dir / "summary.md", victim / "precious.txt")
    res = make_report(lay.root, None)
    summary = lay.report_dir / "summary.md"
    assert not summary.is_symlink() and "| 3 |" in summary.read_text(), res
