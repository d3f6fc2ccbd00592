"""Activation checkpointing of decoder blocks: full or selective, every N-th block.

A checkpointed block keeps only its input during forward and runs again in backward to rebuild
what its backward needs (PyTorch's non-reentrant `torch.utils.checkpoint`). In selective mode the
outputs of chosen operators are kept as well, so the recomputation skips them: keeping attention
outputs, for instance, avoids recomputing the attention kernel, the costliest part of a long
sequence, at a memory cost of one [tokens, hidden] tensor per block.

The block's `forward` is replaced on the instance rather than the block wrapped in another module,
so parameter names (the keys of checkpoints and optimizer state) are the same with and without
checkpointing, and FSDP2 still shards the block itself: its hooks gather the parameters before
the forward and again before the backward, where the recomputation runs.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from coordination.config import ConfigError

# Friendly target names of train.ac.targets -> aten operators whose outputs selective mode keeps.
_NAMED_TARGETS = {
    "attention": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_attention_math"),
    "matmul": ("mm", "addmm", "bmm"),
}


def resolve_targets(names: list[str]) -> list:
    """aten overloads for train.ac.targets: 'attention', 'matmul', or 'aten.<op>[.<overload>]'."""
    ops = []
    for name in names:
        if name in _NAMED_TARGETS:
            for op in _NAMED_TARGETS[name]:
                packet = getattr(torch.ops.aten, op, None)
                if packet is not None:
                    ops.extend(getattr(packet, o) for o in packet.overloads())
            continue
        parts = name.split(".")
        packet = getattr(torch.ops.aten, parts[1], None) if len(parts) in (2, 3) and parts[0] == "aten" else None
        overload = parts[2] if len(parts) == 3 else None
        if packet is None or (overload is not None and overload not in packet.overloads()):
            raise ConfigError(f"train.ac.targets: {name!r} is not an operator; use 'attention', 'matmul' or an aten "
                              f"operator such as 'aten.mm' or 'aten.mm.default'")
        ops.extend([getattr(packet, overload)] if overload else [getattr(packet, o) for o in packet.overloads()])
    return ops


def _checkpointed(forward: Callable, context_fn: Callable | None) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_activation_checkpointing(blocks: list[nn.Module], *, freq: int, mode: str, targets: list[str]) -> int:
    """Checkpoint blocks 0, freq, 2*freq, ... ; returns how many blocks are checkpointed."""
    if freq <= 0:
        return 0
    context_fn = None
    if mode == "selective":
        ops = resolve_targets(targets)
        context_fn = functools.partial(create_selective_checkpoint_contexts, ops)
    elif mode != "full":
        raise ConfigError(f"train.ac.mode must be full or selective (got {mode!r})")
    count = 0
    for i, block in enumerate(blocks):
        if i % freq == 0:
            block.forward = _checkpointed(block.forward, context_fn)
            count += 1
    return count
