"""The process group of a trainer: who am I, on which device, and agreeing with the others.

Started by torchrun, a process reads RANK / WORLD_SIZE / LOCAL_RANK and joins the group torchrun's
rendezvous set up (gloo on CPU, NCCL on CUDA). Started as a plain `python -m ...`, it forms a
group of one over an in-memory store, so FSDP2 and DDP run the same code in one process.

`agree(ok)` is how ranks decide together: every rank contributes whether its local work
succeeded, and if any did not, every rank raises. A rank that fails while loading inputs or
writing its files therefore does not leave its peers waiting in a collective.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PeerFailed(RuntimeError):
    """Another rank reported a failure; this rank stops too."""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int:
    """WORLD_SIZE torchrun set, or 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def process_group_backend(device_type: str) -> str:
    """The backend string of the trainer's process group. On CUDA, collectives on device tensors run
    on NCCL, and the group always has gloo for CPU tensors beside it (as torchtitan does): the levers
    that keep tensors in host memory (fsdp_cpu_offload, optim_cpu_offload) need it for gradient
    clipping's norm and state-dict gathers, and a resident process forms its group once, from its
    first plan, while a later plan of the same launch may turn such a lever on. On CPU, gloo does
    everything."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def init_distributed(timeout_s: float) -> DistInfo:
    """Join (or form) the process group (process_group_backend): one GPU per process on CUDA,
    gloo on CPU."""
    timeout = datetime.timedelta(seconds=timeout_s)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = process_group_backend(device.type)
        if torchrun:
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, timeout=timeout, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()



def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Elementwise sum of `values` over all ranks (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def agree(ok: bool, what: str, info: DistInfo) -> None:
    """Collective: raise PeerFailed on every rank unless every rank's `ok` is True."""
    flags = torch.zeros(info.world_size, dtype=torch.float64, device=info.device)
    flags[info.rank] = 0.0 if ok else 1.0
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if failed:
        raise PeerFailed(f"{what} failed on trainer rank(s) {failed}; see their log lines above for the cause")


def agreed(what: str, info: DistInfo, fn):
    """Run the local work `fn()` on every rank, then agree: returns fn's result when every rank
    succeeded; otherwise raises on every rank (this rank's own error where it failed)."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 -- reported to the peers, then re-raised below
        result, error = None, exc
    try:
        agree(error is None, what, info)
    except PeerFailed:
        if error is not None:
            raise error
        raise
    return result
