"""Which tasks each rank rolls out (docs/design.md §7 "Split").

An iteration's tasks are a seeded sample of the pool, reproducible from (seed, iteration) on
every node without talking. Ranks get contiguous slices of that sample whose sizes come from
largest-remainder (Hamilton) apportionment of the rank weights: the slices are disjoint, cover
every task (no floor-rounding loss), and a task's whole group of samples is rolled out by the
one rank whose slice holds the task. Quotas are computed with exact fractions, so every node
gets the same answer whatever its floating-point quirks.
"""
from __future__ import annotations

import hashlib
import math
import random
from fractions import Fraction
from typing import Sequence, TypeVar

T = TypeVar("T")


def check_rank_weights(weights: Sequence[float]) -> list[Fraction]:
    """The one rule of rank weights, wherever they come from: finite, none negative, at least one
    positive. A weight of 0 gives its rank no tasks (as a rank beyond the task count gets none)."""
    if not weights:
        raise ValueError("rank weights are empty; give one weight per rank (for example --rank-weights 1,1)")
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"rank weight {i} is {w!r}; weights must be finite numbers >= 0 (for example "
                             f"--rank-weights 2,1)")
        out.append(Fraction(w))
    if sum(out) <= 0:
        raise ValueError(f"rank weights {list(weights)} sum to zero; at least one rank needs a positive weight")
    return out


def parse_rank_weights(text: str) -> list[float]:
    """`--rank-weights 2,1` -> [2.0, 1.0], held to `check_rank_weights` (ValueError names the fix)."""
    weights = []
    for p in (p.strip() for p in text.split(",")):
        try:
            weights.append(float(p))
        except ValueError:
            raise ValueError(f"--rank-weights {text!r}: {p!r} is not a number; give one weight per node, "
                             f"e.g. 2,1") from None
    try:
        check_rank_weights(weights)
    except ValueError as exc:
        raise ValueError(f"--rank-weights {text!r}: {exc}") from None
    return weights


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` items into integer shares proportional to `weights` (largest remainder).

    The shares sum to `total`; each share is the floor or the ceiling of its exact quota; ties
    between equal remainders go to the lower rank."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be a non-negative integer (got {total!r})")
    ws = check_rank_weights(weights)
    wsum = sum(ws)
    quotas = [total * w / wsum for w in ws]
    shares = [math.floor(q) for q in quotas]
    left = total - sum(shares)
    by_remainder = sorted(range(len(ws)), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[:left]:
        shares[i] += 1
    return shares


def iteration_seed(seed: int, iteration: int, purpose: str = "tasks") -> int:
    """A 64-bit seed derived from (seed, iteration, purpose), the same on every platform."""
    digest = hashlib.sha256(f"baton/{purpose}/{seed}/{iteration}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def sample_iteration(tasks: Sequence[T], n: int, *, seed: int, iteration: int) -> list[T]:
    """This iteration's `n` tasks: a seeded sample without replacement from the pool."""
    if n < 1:
        raise ValueError(f"tasks_per_iteration must be at least 1 (got {n})")
    if n > len(tasks):
        raise ValueError(f"tasks.tasks_per_iteration={n} exceeds the {len(tasks)} tasks of the train file; "
                         f"lower tasks_per_iteration or add tasks")
    return random.Random(iteration_seed(seed, iteration)).sample(list(tasks), n)


def select_eval(tasks: Sequence[T], n: int, *, seed: int) -> list[T]:
    """The eval tasks: all of them for n == 0, else the same seeded sample of n at every evaluation."""
    if n == 0:
        return list(tasks)
    if n > len(tasks):
        raise ValueError(f"tasks.eval_tasks={n} exceeds the {len(tasks)} tasks of the eval file; "
                         f"lower eval_tasks or use 0 for the whole file")
    return random.Random(iteration_seed(seed, 0, "eval")).sample(list(tasks), n)


def split_plan(tasks: Sequence[T], weights: Sequence[float]) -> list[list[T]]:
    """Contiguous slices of `tasks`, one per rank, sized by `apportion(len(tasks), weights)`."""
    shares = apportion(len(tasks), weights)
    out, start = [], 0
    for share in shares:
        out.append(list(tasks[start:start + share]))
        start += share
    return out


def rank_slice(tasks: Sequence[T], weights: Sequence[float], rank: int) -> list[T]:
    """The slice of `rank` (0 = master) in `split_plan(tasks, weights)`."""
    if not 0 <= rank < len(weights):
        raise ValueError(f"rank {rank} has no weight: {len(weights)} rank weights cover ranks 0..{len(weights) - 1}")
    shares = apportion(len(tasks), weights)
    start = sum(shares[:rank])
    return list(tasks[start:start + shares[rank]])
