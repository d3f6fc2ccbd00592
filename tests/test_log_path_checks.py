"""`--log-path` is checked before anything is written, and a refusal leaves nothing behind: a
world-writable folder above it without the sticky bit is refused (anyone could swap the run
folder), and on a full filesystem the run folder is not left created."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from coordination.manifest import JoinRefused, UnusableLogPath, check_log_path
from rollout.tasks import arithmetic_tasks, write_tasks
from tests.e2e import RUN_SH, weightless_model
from tests.procs import ROOT, env


def _run_sh(tmp_path: Path, log: Path, *extra: str) -> subprocess.CompletedProcess:
    data = tmp_path / "data"
    if not data.exists():
        train, ev = arithmetic_tasks(64, 8, digits=2, seed=1)
        data.mkdir()
        write_tasks(data / "train.jsonl", train)
        write_tasks(data / "eval.jsonl", ev)
    model = tmp_path / "model"
    if not model.exists():
        weightless_model(model)
    cmd = [RUN_SH, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both", "--eval-interval", "1",
           f"model.path={model}", "tasks.reward=tests.e2e_rewards:starts_with_digit", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


@pytest.fixture
def shared(tmp_path):
    """A folder like a misconfigured shared scratch space: everyone may write, no sticky bit."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    os.chmod(folder, 0o777)
    return folder


def test_a_world_writable_parent_without_the_sticky_bit_is_refused_before_anything_is_created(shared):
    for log in (shared / "run", shared / "team" / "run"):
        with pytest.raises(JoinRefused, match=rf"the folder {shared} above it is world-writable without the "
                                              rf"sticky bit \(mode drwxrwxrwx\).*chmod o-w {shared}"):
            check_log_path(log)
        assert list(shared.iterdir()) == []


def test_a_world_writable_parent_with_the_sticky_bit_is_accepted(shared):
    os.chmod(shared, 0o1777)   # like /tmp: others cannot rename or delete what this user owns there
    check_log_path(shared / "run")
    assert (shared / "run").is_dir()


@pytest.mark.slow  # a start and a dry run that load the model's config and tokenizer: ~25 s on 2 loaded cores
def test_run_sh_and_its_dry_run_refuse_a_world_writable_parent(tmp_path, shared):
    log = shared / "run"
    res = _run_sh(tmp_path, log)
    assert res.returncode == 3 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "world-writable without the sticky bit" in res.stderr and list(shared.iterdir()) == []
    dry = _run_sh(tmp_path, log, "--dry-run")
    assert dry.returncode == 2, dry.stderr[-2000:]
    assert "would stop here (exit 2)" in dry.stderr and "world-writable without the sticky bit" in dry.stderr
    assert list(shared.iterdir()) == []


def test_a_full_filesystem_is_refused_without_leaving_the_run_folder_created(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.decode().strip()}); needs root")
    try:
        os.chmod(full, 0o750)
        try:
            with open(full / "filler", "wb") as fh:
                while True:
                    fh.write(b"x" * 4096)
        except OSError:
            pass  # full: mkdir still works on tmpfs, the first data block does not
        log = full / "runs" / "r1"
        with pytest.raises(UnusableLogPath, match=r"is on a full filesystem"):
            check_log_path(log)
        assert sorted(p.name for p in full.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(full)], check=True)
