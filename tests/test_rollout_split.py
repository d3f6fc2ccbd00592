"""Properties of the rank-weight split: disjoint, complete, proportional, reproducible."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.split import apportion, rank_slice, sample_iteration, select_eval, split_plan

weights_st = st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=1, max_size=12).filter(
    lambda ws: sum(ws) > 0)


@given(total=st.integers(min_value=0, max_value=10_000), weights=weights_st)
def test_apportion_is_complete_and_within_one_of_the_exact_quota(total, weights):
    shares = apportion(total, weights)
    assert sum(shares) == total
    wsum = sum(Fraction(w) for w in weights)
    for share, w in zip(shares, weights):
        quota = total * Fraction(w) / wsum
        assert math.floor(quota) <= share <= math.ceil(quota)
        if w == 0:
            assert share == 0


@given(total=st.integers(min_value=0, max_value=10_000), weights=weights_st)
def test_apportion_never_gives_a_heavier_rank_less(total, weights):
    shares = apportion(total, weights)
    for i in range(len(weights)):
        for j in range(len(weights)):
            if weights[i] > weights[j]:
                assert shares[i] >= shares[j]


@given(n=st.integers(min_value=0, max_value=500), weights=weights_st)
def test_split_plan_slices_are_contiguous_disjoint_and_cover_every_task(n, weights):
    tasks = [f"t{i}" for i in range(n)]
    plan = split_plan(tasks, weights)
    assert len(plan) == len(weights)
    assert [t for part in plan for t in part] == tasks          # contiguous, in order, nothing lost
    assert [len(p) for p in plan] == apportion(n, weights)
    assert [rank_slice(tasks, weights, r) for r in range(len(weights))] == plan


@settings(max_examples=50)
@given(pool=st.integers(min_value=1, max_value=300), data=st.data(), seed=st.integers(0, 2**31),
       iteration=st.integers(0, 10_000))
def test_iteration_sample_is_reproducible_from_seed_and_iteration(pool, data, seed, iteration):
    tasks = list(range(pool))
    n = data.draw(st.integers(min_value=1, max_value=pool))
    a = sample_iteration(tasks, n, seed=seed, iteration=iteration)
    assert a == sample_iteration(list(tasks), n, seed=seed, iteration=iteration)
    assert len(a) == n and len(set(a)) == n and set(a) <= set(tasks)


def test_iteration_samples_differ_between_iterations_and_seeds():
    tasks = list(range(1000))
    a = sample_iteration(tasks, 64, seed=0, iteration=1)
    assert a != sample_iteration(tasks, 64, seed=0, iteration=2)
    assert a != sample_iteration(tasks, 64, seed=1, iteration=1)


def test_each_task_group_belongs_to_exactly_one_rank():
    tasks = sample_iteration([f"t{i}" for i in range(1000)], 500, seed=3, iteration=7)
    plan = split_plan(tasks, [1.0, 2.5, 0.5])
    owners = {}
    for rank, part in enumerate(plan):
        for t in part:
            assert t not in owners
            owners[t] = rank
    assert len(owners) == 500
    assert [len(p) for p in plan] == [125, 313, 62]  # tie on .5 goes to the lower rank


def test_largest_remainder_known_cases():
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(7, [0.5, 0.25, 0.25]) == [3, 2, 2]
    assert apportion(5, [3, 0, 1]) == [4, 0, 1]
    assert apportion(0, [1, 2]) == [0, 0]


def test_bad_split_inputs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="exceeds the 10 tasks"):
        sample_iteration(list(range(10)), 11, seed=0, iteration=1)
    with pytest.raises(ValueError, match="sum to zero"):
        apportion(3, [0, 0])
    with pytest.raises(ValueError, match=r"rank weight 1 is -1"):
        apportion(3, [1, -1])
    with pytest.raises(ValueError, match=r"rank 2 has no weight"):
        rank_slice([1, 2], [1, 1], 2)
    with pytest.raises(ValueError, match="exceeds the 3 tasks of the eval file"):
        select_eval([1, 2, 3], 4, seed=0)


def test_eval_selection_is_the_whole_file_or_the_same_sample_every_time():
    tasks = list(range(100))
    assert select_eval(tasks, 0, seed=5) == tasks
    assert select_eval(tasks, 10, seed=5) == select_eval(tasks, 10, seed=5)
