"""Packing samples into micro-batches by token budget and dealing them to ranks."""
from __future__ import annotations

import random

import pytest

from train.packing import PackingError, pack_step, padded_cost, split_steps


def _lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 40) for _ in range(n)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_sample_lands_once_within_budget_and_ranks_run_equal_micro_batch_counts(world_size):
    lengths = _lengths(50)
    pack = pack_step(list(range(50)), lengths, budget=128, world_size=world_size)
    seen = [i for rank in pack.ranks for mb in rank for i in mb]
    assert sorted(seen) == list(range(50))
    for rank in pack.ranks:
        assert len(rank) <= pack.micro_batches_per_rank
        for mb in rank:
            assert padded_cost([lengths[i] for i in mb]) <= 128
    # no rank is left idle while another has two micro-batches more
    counts = [len(r) for r in pack.ranks]
    assert max(counts) - min(counts) <= 1


def test_packing_is_deterministic():
    lengths = _lengths(40, seed=3)
    a = pack_step(list(range(40)), lengths, budget=100, world_size=2)
    b = pack_step(list(range(40)), lengths, budget=100, world_size=2)
    assert a == b


def test_fewer_samples_than_ranks_leaves_empty_micro_batches_for_the_trainer_to_fill():
    pack = pack_step([7], [10], budget=64, world_size=2)
    assert pack.micro_batches_per_rank == 1
    assert sorted(len(r) for r in pack.ranks) == [0, 1]


def test_sample_longer_than_budget_is_refused_with_the_key_to_raise():
    with pytest.raises(PackingError, match=r"micro_batch_tokens=16.*at least 20"):
        pack_step([0, 1], [10, 20], budget=16, world_size=1)


def test_steps_split_into_near_equal_contiguous_parts():
    assert split_steps(list(range(10)), 4) == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]
    assert split_steps([1, 2], 4) == [[1], [2]]
