"""The trainer's process-group backend: NCCL on CUDA plus gloo for the CPU whenever a lever keeps
trainer tensors in host memory; gloo alone on CPU runs (train/distributed.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from torch.distributed.distributed_c10d import Backend, BackendConfig

from rl.runconfig import load_run_config
from tests.procs import ROOT, env
from train.distributed import offloads_to_cpu, process_group_backend


def _devices(backend: str) -> dict[str, str]:
    """How torch maps devices to backends for this string (what init_process_group will use)."""
    return BackendConfig(Backend(backend)).get_device_backend_map()


@pytest.mark.parametrize("lever", ["train.fsdp_cpu_offload=true", "train.optim_cpu_offload=true"])
def test_cuda_trainer_that_offloads_to_cpu_gets_gloo_for_cpu_tensors(lever):
    train = load_run_config([], [lever]).train
    assert offloads_to_cpu(train) and offloads_to_cpu({k: getattr(train, k) for k in
                                                       ("fsdp_cpu_offload", "optim_cpu_offload")})
    backend = process_group_backend("cuda", cpu_offload=offloads_to_cpu(train))
    assert backend == "cuda:nccl,cpu:gloo"
    assert _devices(backend) == {"cuda": "nccl", "cpu": "gloo"}


def test_cuda_trainer_without_offload_stays_nccl_only_and_cpu_runs_stay_gloo():
    train = load_run_config([], []).train
    assert not offloads_to_cpu(train)
    # plain NCCL has no backend for CPU tensors: the "No backend type associated with device type
    # cpu" of issue 12 when anything lives on the host
    assert _devices(process_group_backend("cuda", cpu_offload=False)) == {"cuda": "nccl"}
    assert process_group_backend("cpu", cpu_offload=False) == "gloo"
    assert process_group_backend("cpu", cpu_offload=True) == "gloo"


def test_cpu_trainer_with_offload_levers_forms_a_gloo_group():
    code = ("import torch.distributed as dist\n"
            "from train.distributed import init_distributed, shutdown\n"
            "info = init_distributed(30.0, cpu_offload=True)\n"
            "print(info.device.type, dist.get_backend(), dist.get_world_size())\n"
            "shutdown()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["cpu", "gloo", "1"]
