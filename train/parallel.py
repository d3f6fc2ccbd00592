"""Data parallelism over the trainer ranks: FSDP2 (`fully_shard`) or DDP.

FSDP2 follows the PyTorch recipe: `fully_shard` each decoder block, then the root module; on
CUDA a `MixedPrecisionPolicy` computes in bfloat16 and reduces gradients in float32 while the
sharded float32 parameters stay the optimizer's master weights. DDP replicates the float32 model
and uses autocast for a lower compute dtype.

FSDP2's options are config keys (train/config.py):
- `reshard_after_forward`: free each block's gathered parameters after its forward (gathered
  again for backward) or keep them until backward (less communication, more memory);
- `dp_replicate`: HSDP, a 2-D mesh (dp_replicate x dp_shard): parameters are sharded within a
  group of dp_shard ranks (usually one node) and replicated across the dp_replicate groups, so
  all-gathers stay inside a group and only gradients cross groups;
- `fsdp_cpu_offload`: FSDP2's `CPUOffloadPolicy`: sharded parameters, their gradients and the
  optimizer state live in CPU memory; each block's parameters are copied to the device for its
  forward and backward, and the optimizer step runs on the CPU.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from coordination.config import ConfigError
from train.config import check_world_size
from train.distributed import DistInfo
from train.expert import shard_experts
from train.model import Policy, decoder_blocks


def device_mesh(info: DistInfo, dp_replicate: int):
    """1-D mesh over all ranks, or the 2-D (dp_replicate, dp_shard) mesh of HSDP."""
    check_world_size(dp_replicate, info.world_size)
    if dp_replicate == 1:
        return init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(info.device.type, (dp_replicate, info.world_size // dp_replicate),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_parallelism(policy: Policy, backend: str, info: DistInfo, dtype: torch.dtype, *,
                      reshard_after_forward: bool = True, dp_replicate: int = 1,
                      cpu_offload: bool = False, ep: int = 1) -> nn.Module:
    """Return the module to call for forward/backward; `policy` keeps its parameters (sharded
    DTensors under FSDP2, the replicated tensors under DDP). `ep` > 1: the experts are sharded
    over EP groups first (train/expert.py) and FSDP2 shards the rest."""
    if backend == "fsdp":
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                            register_fsdp_forward_method)

        experts: set[nn.Parameter] | None = None
        if ep > 1:
            experts = shard_experts(policy.lm, info, ep)
        mesh = device_mesh(info, dp_replicate)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
            else MixedPrecisionPolicy()
        # Pinned host memory makes the copies to the GPU asynchronous; there is none without CUDA.
        offload = CPUOffloadPolicy(pin_memory=info.device.type == "cuda") if cpu_offload else OffloadPolicy()
        for block in decoder_blocks(policy.lm):
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload,
                        reshard_after_forward=reshard_after_forward, ignored_params=experts)
        # The root (embedding, final norm, LM head) is left to FSDP2's default (None), which keeps
        # its parameters gathered from the forward to the backward that follows at once.
        fully_shard(policy, mesh=mesh, mp_policy=mp, offload_policy=offload, ignored_params=experts)
        register_fsdp_forward_method(policy, "generate")
        return policy
    if backend == "ddp":
        if dp_replicate != 1 or cpu_offload:
            raise ConfigError("train.dp_replicate and train.fsdp_cpu_offload are FSDP2 options; set train.backend=fsdp")
        policy.to(info.device)
        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(policy, device_ids=ids)
    raise ValueError(f"unknown backend {backend!r}; use fsdp or ddp")


@contextlib.contextmanager
def compute_context(backend: str, dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Autocast for DDP with a low-precision compute dtype; FSDP2 casts through its policy."""
    if backend == "ddp" and dtype != torch.float32:
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield
    else:
        yield


def accumulation_context(model: nn.Module, backend: str, last: bool) -> contextlib.AbstractContextManager:
    """DDP all-reduces gradients only on the last micro-batch of a step. FSDP2 reduce-scatters
    after every micro-batch, which keeps only sharded gradients in memory."""
    if backend == "ddp" and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global gradient norm over all ranks (clipped in place when max_norm > 0)."""
    from torch.distributed.tensor import DTensor

    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    meshes = {id(p.grad.device_mesh) for p in grads if isinstance(p.grad, DTensor)}
    if len(meshes) > 1:
        return _clip_across_meshes(grads, max_norm)
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _clip_across_meshes(params: list[nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm for gradients on several device meshes (expert parallelism: the experts'
    mesh beside FSDP2's), which torch's foreach norm cannot mix: one norm per mesh, combined."""
    from torch.distributed.tensor import DTensor

    groups: dict[int, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else 0, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = float(torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms])))
    # The same coefficient as torch.nn.utils.clip_grads_with_norm_.
    coef = max_norm / (total + 1e-6)
    if max_norm > 0 and coef < 1:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def full_state_dict(policy: Policy) -> dict[str, torch.Tensor]:
    """Collective: the full float32 state dict on CPU on rank 0 under HF names; {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sd = {k.removeprefix("lm."): v for k, v in sd.items()}
    # A tied LM head appears under both names, and the gathered copies no longer share storage,
    # so save_pretrained cannot see the tie: keep each parameter under its first name only.
    own = {n for n, _ in policy.lm.named_parameters()} | {n for n, _ in policy.lm.named_buffers()}
    return {k: v for k, v in sd.items() if k in own}
