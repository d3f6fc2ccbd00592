"""The gpu tier cannot pass without running: on a machine that should have a usable GPU, a CUDA
that torch cannot use fails every gpu test with the driver requirement; elsewhere they are skipped.
Run on this CPU machine through a child pytest, with BATON_REQUIRE_GPU standing in for a GPU node."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.procs import ROOT, env


def _gpu_tier(**extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"], cwd=ROOT, env=env(CUDA_VISIBLE_DEVICES="", **extra),
                          capture_output=True, text=True, timeout=300)


def test_a_gpu_node_whose_cuda_is_unusable_fails_the_gpu_tier_naming_the_driver_requirement():
    res = _gpu_tier(BATON_REQUIRE_GPU="1")
    assert res.returncode == 1, res.stdout[-2000:]
    assert "although BATON_REQUIRE_GPU=1" in res.stdout and "NVIDIA driver >= 580" in res.stdout
    last = res.stdout.splitlines()[-1]
    assert re.search(r"\b\d+ errors?\b", last) and "passed" not in last and "skipped" not in last


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")
def test_a_machine_without_a_gpu_skips_the_gpu_tier():
    res = _gpu_tier(BATON_REQUIRE_GPU="")
    assert res.returncode == 0, res.stdout[-2000:]
    assert "skipped" in res.stdout.splitlines()[-1] and "failed" not in res.stdout.splitlines()[-1]
