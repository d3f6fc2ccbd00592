"""Splitting an iteration's samples into optimizer steps, micro-batches and trainer ranks.

A micro-batch is a right-padded [rows, longest] block, so its cost is rows x longest tokens;
`budget` bounds that cost (activation memory). Every rank must run the same number of
forward/backward passes in a step, because FSDP and DDP communicate inside each of them: a step
gives each rank exactly `micro_batches_per_rank` micro-batches, and a rank with fewer samples
than that runs empty ones (the trainer gives them zero loss weight).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


class PackingError(ValueError):
    """Samples that cannot be packed under the token budget; the message says what to change."""


@dataclass(frozen=True)
class StepPack:
    """One optimizer step: `ranks[r]` is rank r's list of micro-batches (lists of sample indices),
    at most `micro_batches_per_rank` long; missing ones are empty."""

    ranks: list[list[list[int]]]
    micro_batches_per_rank: int


def padded_cost(lengths: Sequence[int]) -> int:
    return len(lengths) * max(lengths) if lengths else 0


def split_steps(order: Sequence[int], steps: int) -> list[list[int]]:
    """`order` cut into `steps` contiguous parts whose sizes differ by at most one."""
    steps = max(1, min(steps, len(order)))
    bounds = [i * len(order) // steps for i in range(steps + 1)]
    return [list(order[bounds[i]:bounds[i + 1]]) for i in range(steps)]


def _fill(items: list[tuple[int, int]], bins: int, budget: int) -> list[list[tuple[int, int]]] | None:
    # Longest first, each into the least loaded bin that stays within budget. Since items come
    # longest first, a non-empty bin's padded width is its first item's length.
    out: list[list[tuple[int, int]]] = [[] for _ in range(bins)]
    cost = [0] * bins
    for length, index in items:
        best = None
        for b in range(bins):
            new = length if not out[b] else (len(out[b]) + 1) * out[b][0][0]
            if new <= budget and (best is None or cost[b] < cost[best] or (cost[b] == cost[best] and b < best)):
                best = b
        if best is None:
            return None
        out[best].append((length, index))
        cost[best] = length if len(out[best]) == 1 else len(out[best]) * out[best][0][0]
    return out


def pack_step(indices: Sequence[int], lengths: Sequence[int], *, budget: int, world_size: int) -> StepPack:
    """Pack the samples `indices` (with token `lengths`) into micro-batches for `world_size` ranks.

    Deterministic: equal inputs give equal packs on every machine."""
    if len(indices) != len(lengths):
        raise ValueError(f"{len(indices)} indices but {len(lengths)} lengths")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1 (got {world_size})")
    too_long = [(n, i) for n, i in zip(lengths, indices) if n > budget]
    if too_long:
        n, i = max(too_long)
        raise PackingError(
            f"sample {i} has {n} tokens (prompt + completion), more than train.micro_batch_tokens={budget}; "
            f"raise train.micro_batch_tokens to at least {n} or shorten prompts / rollout.max_new_tokens")
    items = sorted(zip(lengths, indices), key=lambda t: (-t[0], t[1]))
    if not items:
        return StepPack([[] for _ in range(world_size)], 0)
    per_rank = max(1, math.ceil(math.ceil(sum(lengths) / budget) / world_size))
    while True:
        bins = _fill(items, per_rank * world_size, budget)
        if bins is not None:
            break
        per_rank += 1
    # Heaviest micro-batches first, each to the lightest rank that still has room.
    order = sorted(range(len(bins)), key=lambda b: (-padded_cost([n for n, _ in bins[b]]), b))
    ranks: list[list[list[int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for b in order:
        if not bins[b]:
            continue
        r = min((r for r in range(world_size) if len(ranks[r]) < per_rank), key=lambda r: (load[r], r))
        ranks[r].append([i for _, i in bins[b]])
        load[r] += padded_cost([n for n, _ in bins[b]])
    return StepPack(ranks, per_rank)
