"""The trainer's process-group backend: on CUDA always NCCL plus gloo for CPU tensors, so a later
plan of a resident trainer that turns on a host-memory lever finds a CPU backend; gloo alone on CPU
runs (train/distributed.py)."""
from __future__ import annotations

import subprocess
import sys

from torch.distributed.distributed_c10d import Backend, BackendConfig

from tests.procs import ROOT, env
from train.distributed import process_group_backend


def _devices(backend: str) -> dict[str, str]:
    """How torch maps devices to backends for this string (what init_process_group will use)."""
    return BackendConfig(Backend(backend)).get_device_backend_map()


def test_a_cuda_trainer_group_has_gloo_for_cpu_tensors_whatever_its_first_plan_says():
    # A plain NCCL group has no backend for CPU tensors ("No backend type associated with device
    # type cpu") the first time a later plan's fsdp_cpu_offload or optim_cpu_offload needs one.
    assert _devices(process_group_backend("cuda")) == {"cuda": "nccl", "cpu": "gloo"}
    assert process_group_backend("cpu") == "gloo"


def test_a_cpu_trainer_forms_a_gloo_group():
    code = ("import torch.distributed as dist\n"
            "from train.distributed import init_distributed, shutdown\n"
            "info = init_distributed(30.0)\n"
            "print(info.device.type, dist.get_backend(), dist.get_world_size())\n"
            "shutdown()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["cpu", "gloo", "1"]
