"""Which samples an update trains on, and with what weight (docs/design.md §7, phase 8).

GRPO: a sample's advantage is its reward minus the mean reward of its group (the samples of one
task in one iteration), optionally divided by the group's population std plus `std_eps`. A group
whose rewards are all equal teaches nothing (every advantage is 0) and is dropped, so it costs
no compute and does not dilute the token normalisation.

Rejection sampling (rft, the reference pipeline's update): keep the samples whose reward reaches
`min_reward` and train on them with the SFT loss; their "advantage" is 1.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Selection:
    """Indices of kept samples with their advantages, plus counts for the plan and the logs."""

    indices: list[int]
    advantages: list[float]
    groups: int
    groups_kept: int
    zero_advantage_groups: int

    @property
    def samples_kept(self) -> int:
        return len(self.indices)


def groups_of(task_ids: Sequence[str]) -> dict[str, list[int]]:
    """task id -> sample indices, in first-seen order (deterministic)."""
    out: dict[str, list[int]] = defaultdict(list)
    for i, task_id in enumerate(task_ids):
        out[task_id].append(i)
    return dict(out)


def group_advantages(rewards: Sequence[float], *, std_normalize: bool, std_eps: float) -> np.ndarray:
    """Advantages of one group: r - mean(r), divided by (std(r) + std_eps) when asked.

    The std is the population std (ddof 0): with the usual 8-16 samples per group the choice
    hardly matters, and ddof 0 keeps a group of one defined (its advantage is 0)."""
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean()
    if std_normalize:
        adv = adv / (r.std() + std_eps)
    return adv


def grpo_selection(task_ids: Sequence[str], rewards: Sequence[float], *, std_normalize: bool,
                   std_eps: float) -> Selection:
    """Advantages for every sample of the groups that have any reward spread; others dropped."""
    if len(task_ids) != len(rewards):
        raise ValueError(f"{len(task_ids)} task ids but {len(rewards)} rewards")
    indices: list[int] = []
    advantages: list[float] = []
    groups = groups_of(task_ids)
    zero = 0
    for members in groups.values():
        group_rewards = [rewards[i] for i in members]
        if max(group_rewards) == min(group_rewards):
            zero += 1
            continue
        adv = group_advantages(group_rewards, std_normalize=std_normalize, std_eps=std_eps)
        indices.extend(members)
        advantages.extend(float(a) for a in adv)
    return Selection(indices, advantages, len(groups), len(groups) - zero, zero)


def rft_selection(task_ids: Sequence[str], rewards: Sequence[float], *, min_reward: float) -> Selection:
    """Successful samples (reward >= min_reward), each with weight 1."""
    if len(task_ids) != len(rewards):
        raise ValueError(f"{len(task_ids)} task ids but {len(rewards)} rewards")
    indices = [i for i, r in enumerate(rewards) if r >= min_reward]
    groups = groups_of(task_ids)
    kept_groups = len({task_ids[i] for i in indices})
    return Selection(indices, [1.0] * len(indices), len(groups), kept_groups, len(groups) - kept_groups)
