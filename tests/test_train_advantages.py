"""GRPO advantages and rejection-sampling selection against hand-computed values."""
from __future__ import annotations

import math

import pytest

from train.advantages import group_advantages, grpo_selection, rft_selection


def test_advantage_is_reward_minus_group_mean_divided_by_population_std_plus_eps():
    # rewards [1, 0, 0, 0]: mean 0.25, population std sqrt(0.1875) = 0.4330127
    std = math.sqrt(0.1875)
    adv = group_advantages([1, 0, 0, 0], std_normalize=True, std_eps=1e-4)
    assert adv.tolist() == pytest.approx([0.75 / (std + 1e-4)] + [-0.25 / (std + 1e-4)] * 3)
    raw = group_advantages([1, 0, 0, 0], std_normalize=False, std_eps=1e-4)
    assert raw.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_groups_with_equal_rewards_are_dropped_and_counted():
    task_ids = ["a", "a", "b", "b", "c", "c", "c"]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    sel = grpo_selection(task_ids, rewards, std_normalize=False, std_eps=1e-4)
    assert sel.indices == [0, 1]
    assert sel.advantages == pytest.approx([0.5, -0.5])
    assert (sel.groups, sel.groups_kept, sel.zero_advantage_groups) == (3, 1, 2)


def test_group_membership_follows_task_id_not_row_order():
    sel = grpo_selection(["x", "y", "x", "y"], [1.0, 0.5, 0.0, 0.5], std_normalize=False, std_eps=1e-4)
    assert sel.indices == [0, 2]
    assert sel.advantages == pytest.approx([0.5, -0.5])


def test_every_group_zero_gives_an_empty_selection():
    sel = grpo_selection(["a", "a", "b"], [0.0, 0.0, 1.0], std_normalize=True, std_eps=1e-4)
    assert sel.indices == [] and sel.zero_advantage_groups == 2


def test_rejection_sampling_keeps_successful_samples_with_weight_one():
    sel = rft_selection(["a", "a", "b", "b"], [1.0, 0.0, 0.5, 1.0], min_reward=1.0)
    assert sel.indices == [0, 3]
    assert sel.advantages == [1.0, 1.0]
    assert (sel.groups, sel.groups_kept) == (2, 2)
