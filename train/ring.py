"""Ring attention (`train.cp_kind=ring`): the second kind of context parallelism, in plain torch.

Each rank of a CP group keeps its query slice [B, h, S, D] (positions [i S, (i+1) S), sliced
as for Ulysses, train/context.py). Keys and values travel around the ring of the group: cp - 1
shifts, each sending to the next rank and receiving from the previous one, so after them rank i
has seen every slice. Slice j's block of attention is plain q @ k^T * scaling: causal inside the
rank's own slice (j == i), unmasked for earlier slices (j < i), and skipped for later slices
(j > i), which causality masks entirely. Every block keeps its logsumexp, and the blocks merge
by the log-sum-exp rule into exactly softmax over all positions; autograd differentiates the
blocks and the merge. No head is split, so nothing requires heads or kv heads to divide by cp;
GQA repeats the kv heads to the query heads after they arrive (the ring carries kv_heads only).

No flash kernel: the scores are materialised in float32, QUERY_CHUNK queries at a time
([B, h, QUERY_CHUNK, S] while a chunk runs), each chunk under non-reentrant activation
checkpointing, so autograd keeps only its inputs (the queries and the kv slice, which the rank
holds anyway) and its output and logsumexp, and recomputes the scores in backward: per rank the
kv slices of earlier ranks and O(S) per block, the same order as Ulysses' exchanged tensors.
The price is one more block forward in backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from train.context_rules import RING_QUERY_CHUNK


def _neighbours(group, index: int, cp: int) -> tuple[int, int]:
    """Global ranks of the next and the previous rank of the ring."""
    return dist.get_global_rank(group, (index + 1) % cp), dist.get_global_rank(group, (index - 1) % cp)


def _shift(x: torch.Tensor, group, send_to: int, recv_from: int) -> torch.Tensor:
    """Send `x` on and receive the previous rank's; the waits are bounded by the process group's
    timeout (train/distributed.py), which ends the job if a neighbour never answers."""
    got = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), send_to, group), dist.P2POp(dist.irecv, got, recv_from, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return got


class RingPass(torch.autograd.Function):
    """Forward: the cp slices of a tensor that each rank holds one of, in source order, gathered
    by cp - 1 shifts to the next rank. Backward: the gradients travel the other way, each rank
    adding its own gradient for a slice as it passes, so slice j's total arrives at rank j.

    One Function for all shifts, not one per shift: a rank skips the blocks of later slices, so a
    per-shift node whose output only fed skipped blocks would never run its backward there, and
    the neighbours waiting for that backward's message would hang."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, index: int, cp: int):
        ctx.group, ctx.index, ctx.cp = group, index, cp
        nxt, prev = _neighbours(group, index, cp)
        slices = {index: x}
        held = x
        for step in range(1, cp):                         # after `step` shifts: slice index - step
            held = _shift(held, group, nxt, prev)
            slices[(index - step) % cp] = held
        return tuple(slices[j] for j in range(cp))

    @staticmethod
    def backward(ctx, *grads):
        index, cp, group = ctx.index, ctx.cp, ctx.group
        nxt, prev = _neighbours(group, index, cp)
        like = next(g for g in grads if g is not None)
        grad = [g if g is not None else torch.zeros_like(like) for g in grads]
        # Undo the forward's shifts last to first: the slice this rank received at shift `step`
        # (index - step) goes back to the rank it came from, which adds its own gradient for it.
        total = grad[(index - (cp - 1)) % cp]
        for step in range(cp - 1, 0, -1):
            total = _shift(total, group, prev, nxt) + grad[(index - step + 1) % cp]
        return total, None, None, None


QUERY_CHUNK = RING_QUERY_CHUNK   # read at each call, so a test can cut slices into several chunks


def _block(q: torch.Tensor, kv: torch.Tensor, repeat: int,
           causal_from: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of float32 queries (scaled) over one slice's keys and values, and each
    query's logsumexp over that slice: [B, h, C, D] and [B, h, C, 1]. `causal_from`: the
    queries' first position within the kv slice when it is their own (None: all visible)."""
    k, v = (t.float().repeat_interleave(repeat, dim=1) for t in kv)
    scores = q @ k.transpose(-1, -2)                      # [B, h, C, S]
    if causal_from is not None:
        c, s = scores.shape[-2:]
        later = torch.ones(c, s, dtype=torch.bool, device=q.device).triu(1 + causal_from)
        scores = scores.masked_fill(later, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def _attend(q: torch.Tensor, kv: torch.Tensor, repeat: int, own: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`_block` over QUERY_CHUNK queries at a time, each recomputed in backward: autograd keeps
    the chunk's inputs and results, not its scores. Own slice: a chunk sees keys up to its end."""
    outs, lses = [], []
    for start in range(0, q.shape[2], QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, q.shape[2])
        part = kv[..., :stop, :] if own else kv
        o, l = checkpoint(_block, q[:, :, start:stop], part, repeat, start if own else None, use_reentrant=False)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def ring_attention(module, query, key, value, attention_mask, *, context_parallel, scaling=None, dropout=0.0,
                   **kwargs):
    """transformers attention interface: causal attention of this rank's queries over all
    positions, keys and values arriving around the ring. [B, h, S, D] in, [B, S, h, D] out."""
    if dropout:
        raise ValueError(f"train.cp_kind=ring computes attention without dropout, but the model asks for "
                         f"attention dropout {dropout}; set the model's attention_dropout to 0 or train.cp=1")
    cp, index = context_parallel.cp, context_parallel.index
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    repeat = query.shape[1] // key.shape[1]
    kv = RingPass.apply(torch.stack([key, value]), context_parallel.group, index, cp)
    q = query.float() * scale
    out = lse = None
    for j in range(index + 1):                            # slices after this rank's are fully masked
        block, block_lse = _attend(q, kv[j], repeat, own=j == index)
        if out is None:
            out, lse = block, block_lse
        else:
            merged = torch.logaddexp(lse, block_lse)
            out = out * torch.exp(lse - merged) + block * torch.exp(block_lse - merged)
            lse = merged
    return out.to(query.dtype).transpose(1, 2).contiguous(), None
