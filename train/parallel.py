"""Data parallelism over the trainer ranks: FSDP2 (`fully_shard`) or DDP.

FSDP2 follows the PyTorch recipe: `fully_shard` each decoder block, then the root module, on a
1-D device mesh over all ranks; on CUDA a `MixedPrecisionPolicy` computes in bfloat16 and
reduces gradients in float32 while the sharded float32 parameters stay the optimizer's master
weights. DDP replicates the float32 model and uses autocast for a lower compute dtype.

Later levers are options of `apply_parallelism`: reshard_after_forward, an HSDP 2-D mesh, CPU
offload (`OffloadPolicy`), activation checkpointing per block, torch.compile per block.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from train.distributed import DistInfo
from train.model import Policy, decoder_blocks


def apply_parallelism(policy: Policy, backend: str, info: DistInfo, dtype: torch.dtype) -> nn.Module:
    """Return the module to call for forward/backward; `policy` keeps its parameters (sharded
    DTensors under FSDP2, the replicated tensors under DDP)."""
    if backend == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        mesh = init_device_mesh(info.device.type, (info.world_size,))
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
            else MixedPrecisionPolicy()
        for block in decoder_blocks(policy.lm):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(policy, mesh=mesh, mp_policy=mp)  # the root: embedding, final norm, LM head
        register_fsdp_forward_method(policy, "generate")
        return policy
    if backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

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
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in grads])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def full_state_dict(policy: Policy) -> dict[str, torch.Tensor]:
    """Collective: the full float32 state dict on CPU on rank 0 under HF names; {} elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sd = {k.removeprefix("lm."): v for k, v in sd.items()}
    # A tied LM head appears under both names, and the gathered copies no longer share storage,
    # so save_pretrained cannot see the tie: keep each parameter under its first name only.
    own = {n for n, _ in policy.lm.named_parameters()} | {n for n, _ in policy.lm.named_buffers()}
    return {k: v for k, v in sd.items() if k in own}
