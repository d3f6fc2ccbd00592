"""The slicing arithmetic of context parallelism (train/context.py) in one process: which
positions, targets and rotary positions each rank of a CP group holds, padding included."""
from __future__ import annotations

import pytest
import torch

from train.context import ContextParallel, check_right_padded


def _ranks(cp: int) -> list[ContextParallel]:
    return [ContextParallel(cp, i, group=None) for i in range(cp)]


@pytest.mark.parametrize("cp,length", [(2, 8), (2, 7), (4, 10), (4, 2)])
def test_the_ranks_slices_cover_every_position_once_in_order_padded_at_the_end(cp, length):
    x = torch.arange(1, length + 1).unsqueeze(0).repeat(2, 1)
    slices = [r.local(x) for r in _ranks(cp)]
    per_rank = -(-length // cp)
    assert all(s.shape == (2, per_rank) for s in slices)
    joined = torch.cat(slices, dim=1)
    assert torch.equal(joined[:, :length], x) and (joined[:, length:] == 0).all()
    positions = torch.cat([r.positions(x) for r in _ranks(cp)], dim=1)
    assert torch.equal(positions[0], torch.arange(per_rank * cp))


@pytest.mark.parametrize("cp,length", [(2, 8), (2, 9), (4, 10)])
def test_predictions_follow_their_input_positions_and_the_last_position_predicts_nothing(cp, length):
    # [B, T-1] per-prediction tensors are sliced like the [B, T] inputs whose positions predict them,
    # even when T - 1 and T round to different slice widths.
    inputs = torch.arange(length).unsqueeze(0)
    mask = torch.ones(1, length - 1)
    for r in _ranks(cp):
        assert r.predictions(mask).shape == r.local(inputs).shape
    joined = torch.cat([r.predictions(mask) for r in _ranks(cp)], dim=1)
    assert joined[0, :length - 1].sum() == length - 1 and joined[0, length - 1:].sum() == 0


def test_left_padding_is_refused_and_right_padding_accepted():
    check_right_padded(torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="needs right-padded micro-batches"):
        check_right_padded(torch.tensor([[0, 1, 1, 1]]))
