"""Context parallelism (`train.cp`): one sequence split over cp ranks, DeepSpeed-Ulysses style
(`train.cp_kind=ulysses`, here) or by ring attention (`ring`, train/ring.py).

The trainer processes form a (cp_replicate, cp) mesh, cp consecutive ranks to a group (so a
group stays on one node: cp must divide the processes of a node). Every rank of a group gets
the same micro-batch and keeps a contiguous slice of its token dimension: rank i holds positions
[i * S, (i+1) * S), S = ceil(T / cp), the last slice padded. Everything outside attention is per
token and runs on the slice alone; rotary positions are the slice's global positions.

Around attention, after rope, each of query, key and value [B, heads, S, D] goes through one
all_to_all_single that trades the sequence split for a head split: every rank then holds all T
positions of heads/cp heads (kv heads/cp of a GQA model, which keeps each query head with its kv
head), runs the model's causal attention on them, and a second all_to_all_single trades back.
Both are differentiable (their backward is the reverse exchange), so gradients are exact.

Masks: a micro-batch holds one sample per row, right padded (train/batches.py), so a sample
boundary is a row boundary and causal attention alone already keeps every real token away from
the padding after it; no mask crosses the split. Left-padded input is refused.

Ring attention keeps the same slices, positions, masks and loss; only attention differs.

Loss: each rank computes the per-token loss of its own slice. Summed over all ranks this counts
every token of every group once, and train/step.py's scale (world size / global completion
tokens) with FSDP2's average over all ranks gives the gradient of the global token mean: the
same update as cp=1 on the same global batch.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.nn.functional import all_to_all_single

from train.context_rules import check_cp_heads, check_cp_world
from train.distributed import DistInfo
from train.ring import ring_attention

# The attention implementation names registered with transformers, per train.cp_kind.
ULYSSES = "baton_ulysses"
RING = "baton_ring"


@dataclass
class ContextParallel:
    """This rank's place in its CP group: `index` of `cp`, and the group's process group."""

    cp: int
    index: int
    group: object
    attention: str = ULYSSES   # the registered attention the model runs between whole_sequences

    def span(self, length: int) -> tuple[int, int, int]:
        """(start, stop, padded length) of this rank's slice of `length` positions."""
        per_rank = -(-length // self.cp)
        return self.index * per_rank, (self.index + 1) * per_rank, per_rank * self.cp

    def local(self, x: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """This rank's slice along dim 1 of a [B, L, ...] tensor, padded with `fill` to L' = cp * S."""
        start, stop, padded = self.span(x.shape[1])
        if padded > x.shape[1]:
            pad = x.new_full((x.shape[0], padded - x.shape[1], *x.shape[2:]), fill)
            x = torch.cat([x, pad], dim=1)
        return x[:, start:stop]

    def predictions(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a [B, T-1] per-prediction tensor (targets, loss mask, old logprobs):
        position t predicts token t+1, so the last position T-1 predicts nothing and gets 0."""
        return self.local(torch.cat([x, x.new_zeros((x.shape[0], 1, *x.shape[2:]))], dim=1))

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, stop, _ = self.span(input_ids.shape[1])
        return torch.arange(start, stop, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)

    @contextlib.contextmanager
    def whole_sequences(self, lm: torch.nn.Module) -> Iterator[None]:
        """Plain SDPA (with transformers' own masks) while every rank runs whole sequences of its
        own, as generation does (left-padded prompts, a KV cache); the split attention afterwards."""
        lm.config._attn_implementation = "sdpa"
        try:
            yield
        finally:
            lm.config._attn_implementation = self.attention

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, h, S, D] (this rank's positions, all heads) -> [B, h/cp, cp*S, D] (all positions of
        this rank's heads): chunk j of the heads goes to rank j, which stacks the chunks it
        receives in rank order, i.e. in position order."""
        b, h, s, d = x.shape
        send = x.reshape(b, self.cp, h // self.cp, s, d).permute(1, 2, 0, 3, 4).contiguous()
        got = all_to_all_single(torch.empty_like(send), send, group=self.group)  # [cp (from), h/cp, B, S, D]
        return got.permute(2, 1, 0, 3, 4).reshape(b, h // self.cp, self.cp * s, d)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[B, cp*S, h/cp, D] (attention's output layout) -> [B, S, h, D]: the inverse exchange."""
        b, t, hc, d = x.shape
        s = t // self.cp
        send = x.reshape(b, self.cp, s, hc, d).permute(1, 0, 2, 3, 4).contiguous()
        got = all_to_all_single(torch.empty_like(send), send, group=self.group)  # [cp (head chunk), B, S, h/cp, D]
        return got.permute(1, 2, 0, 3, 4).reshape(b, s, self.cp * hc, d)


def ulysses_attention(module, query, key, value, attention_mask, *, context_parallel: ContextParallel, **kwargs):
    """transformers attention interface: causal SDPA over the whole sequence for heads/cp heads.
    `attention_mask` is None (the interface is not a mask implementation, so transformers builds
    none); the position ids of the slice are dropped, since attention sees all positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("position_ids", None)
    q, k, v = (context_parallel.seq_to_heads(t) for t in (query, key, value))
    out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
    return context_parallel.heads_to_seq(out), None


def context_mesh(info: DistInfo, cp: int):
    """(cp_replicate, cp) over all ranks: cp consecutive ranks split one sequence."""
    return init_device_mesh(info.device.type, (info.world_size // cp, cp), mesh_dim_names=("cp_replicate", "cp"))


def enable_context_parallel(lm: torch.nn.Module, info: DistInfo, cp: int, attn: str, kind: str) -> ContextParallel:
    """Collective: make `lm`'s attention `kind` (ulysses or ring) over CP groups of `cp` ranks;
    returns this rank's place, which Policy.forward passes to the model (train/model.py)."""
    from transformers import AttentionInterface

    check_cp_world(cp, info.world_size)
    check_cp_heads(cp, lm.config.to_dict(), attn, kind)
    mesh = context_mesh(info, cp)
    name, attention = (RING, ring_attention) if kind == "ring" else (ULYSSES, ulysses_attention)
    AttentionInterface.register(name, attention)
    lm.config._attn_implementation = name
    return ContextParallel(cp, mesh.get_local_rank("cp"), mesh.get_group("cp"), name)


def check_right_padded(attention_mask: torch.Tensor) -> None:
    """Context parallelism relies on causality to hide padding (module docstring): refuse a mask
    with a 0 before a 1 in some row."""
    m = attention_mask.bool()
    if (m[:, 1:] & ~m[:, :-1]).any():
        raise ValueError("context parallelism (train.cp > 1) needs right-padded micro-batches (every row's "
                         "attention mask a run of 1s then 0s), as train/batches.py collates them; this batch "
                         "has padding before a token")
