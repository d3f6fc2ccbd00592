"""demo.sh and test.sh share one .venv: the same requirement files, so one stamp; the test tiers."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _venv_set_up_in(tmp_path: Path) -> Path:
    """A copy of the venv helper and the requirement files, and a .venv whose python records
    every call (a real set-up would call it to run pip)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/venv.sh", tmp_path / "scripts/venv.sh")
    for f in ("requirements.txt", "requirements-dev.txt"):
        shutil.copy(ROOT / f, tmp_path / f)
    bin_dir = tmp_path / ".venv/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/python-calls\nexit 0\n")
    (bin_dir / "python").chmod(0o750)
    return tmp_path


def _setup_calls(root: Path, script: str) -> str:
    """Run the venv lines of `script` (everything up to its first use of the venv) in `root`."""
    lines = (ROOT / "scripts" / script).read_text().splitlines()
    head = [ln for ln in lines if ln.startswith(("source scripts/venv.sh", "ensure_"))]
    assert head, f"scripts/{script} does not set up .venv through scripts/venv.sh"
    subprocess.run(["bash", "-euc", "\n".join(head)], cwd=root, check=True, capture_output=True, text=True)
    calls = root / "python-calls"
    return calls.read_text() if calls.exists() else ""


def test_demo_and_test_scripts_stamp_the_venv_from_the_same_files(tmp_path):
    root = _venv_set_up_in(tmp_path)
    first = _setup_calls(root, "test.sh")
    assert "pip install" in first                      # no stamp yet: a real set-up
    stamp = (root / ".venv/.baton-stamp").read_text().strip()
    both = b"".join((ROOT / f).read_bytes() for f in ("requirements.txt", "requirements-dev.txt"))
    assert stamp == hashlib.sha256(both).hexdigest()[:16]
    (root / "python-calls").unlink()
    assert _setup_calls(root, "demo.sh") == ""         # same stamp: demo.sh installs nothing
    assert _setup_calls(root, "test.sh") == ""


def test_the_gpu_tier_is_its_own_run_and_refuses_a_machine_without_cuda():
    """`--gpu` with `--all` is a usage error (exit 2, before any set-up); `--gpu` where torch sees
    no CUDA says so and exits 2 instead of skipping every test."""
    import torch

    both = subprocess.run(["bash", "scripts/test.sh", "--all", "--gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert both.returncode == 2 and "separate runs" in both.stderr
    if torch.cuda.is_available():
        return
    gpu = subprocess.run(["bash", "scripts/test.sh", "--gpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert gpu.returncode == 2 and "sees no CUDA GPU" in gpu.stderr, gpu.stderr[-2000:]


def test_tests_outside_the_gpu_tier_and_their_children_see_no_gpu():
    """On a GPU node the CPU tiers stay on the CPU (tests/conftest.py cpu_tier_on_the_cpu): this
    process, its children and baton's own GPU check see an empty CUDA_VISIBLE_DEVICES."""
    from tests.procs import env
    from train.memory_plan import gpu_visible

    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" and not gpu_visible()
    code = "import os, torch; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.device_count())"
    child = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=120)
    assert child.stdout.split() == ["''", "0"], child.stdout + child.stderr
