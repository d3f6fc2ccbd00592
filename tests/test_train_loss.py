"""Loss functions against values worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch

from train.loss import clipped_policy_loss, kl_k3, micro_batch_loss, token_logprobs_and_entropy


def test_ratio_is_clipped_on_both_sides_only_where_it_helps_the_objective():
    # ratio r = exp(logp - old); clip range [0.8, 1.28]; loss = -min(r A, clip(r) A)
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0])
    old = torch.zeros(5)
    loss, clipped = clipped_policy_loss(torch.log(ratio), old, adv, clip_low=0.2, clip_high=0.28)
    # r=1.5, A=+1: min(1.5, 1.28) = 1.28 -> clipped high
    # r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> clipped low
    # r=0.5, A=+1: min(0.5, 0.8) = 0.5 -> not clipped (a lower ratio is never rewarded by the clip)
    # r=1.5, A=-1: min(-1.5, -1.28) = -1.5 -> not clipped
    # r=1.1, A=2: inside the range -> 2.2
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -0.5, 1.5, -2.2], abs=1e-6)
    assert clipped.tolist() == [True, True, False, False, False]


def test_clipped_tokens_get_no_gradient_and_unclipped_get_minus_advantage_times_ratio():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1])).requires_grad_()
    loss, _ = clipped_policy_loss(logp, torch.zeros(3), torch.tensor([1.0, 1.0, 2.0]), clip_low=0.2, clip_high=0.28)
    loss.sum().backward()
    # d(-r A)/dlogp = -r A for unclipped tokens; 0 for the clipped one.
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5, -2.2], abs=1e-6)


def test_micro_batch_loss_sums_masked_tokens_for_global_token_normalisation():
    # Two samples in two micro-batches: A has 1 completion token with loss 1, B has 3 with loss 0.
    # Token-level normalisation over the global batch: (1 + 0) / 4 = 0.25 (a per-sample mean would give 0.5).
    logp_a = torch.tensor([[math.log(2.0), 5.0]])            # ratio 2 (one masked padding position)
    mask_a = torch.tensor([[1.0, 0.0]])
    a = micro_batch_loss(logp_a, torch.zeros(1, 2), mask_a, algorithm="grpo", old_logp=torch.zeros(1, 2),
                         advantages=torch.full((1, 2), -0.5), clip_low=0.2, clip_high=10.0)
    logp_b = torch.zeros(1, 3)
    b = micro_batch_loss(logp_b, torch.ones(1, 3), torch.ones(1, 3), algorithm="grpo", old_logp=torch.zeros(1, 3),
                         advantages=torch.zeros(1, 3))
    global_tokens = mask_a.sum() + 3
    assert float((a.loss + b.loss) / global_tokens) == pytest.approx(0.25)
    assert b.entropy == pytest.approx(3.0)
    assert a.clipped == 0.0


def test_sft_and_rft_loss_is_negative_log_likelihood_of_completion_tokens():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    parts = micro_batch_loss(logp, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]), algorithm="rft")
    assert float(parts.loss) == pytest.approx(math.log(2) + math.log(4))


def test_kl_k3_estimate_matches_hand_value_and_is_zero_at_the_reference():
    logp = torch.log(torch.tensor([0.5, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.3]))
    # d = ln(0.25 / 0.5) = -ln 2 ; exp(d) - d - 1 = 0.5 + ln 2 - 1
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0], abs=1e-6)
    parts = micro_batch_loss(logp[None], torch.zeros(1, 2), torch.ones(1, 2), algorithm="rft", ref_logp=ref[None],
                             kl_coef=0.1)
    assert float(parts.loss) == pytest.approx(-math.log(0.5) - math.log(0.3) + 0.1 * (0.5 + math.log(2) - 1), abs=1e-6)


def test_logprobs_and_entropy_use_temperature_scaled_logits():
    # Identity head: hidden states are the logits. Logits [0, ln 3] -> probabilities [1/4, 3/4].
    head = torch.nn.Identity()
    hidden = torch.tensor([[[0.0, math.log(3.0)]]])
    logp, ent = token_logprobs_and_entropy(hidden, head, torch.tensor([[1]]), temperature=1.0)
    assert float(logp) == pytest.approx(math.log(0.75))
    assert float(ent) == pytest.approx(-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)))
    # Temperature 2 halves the logits: probabilities 1/(1+sqrt 3) and sqrt 3/(1+sqrt 3).
    logp2, _ = token_logprobs_and_entropy(hidden * 2, head, torch.tensor([[1]]), temperature=2.0)
    assert float(logp2) == pytest.approx(math.log(0.75))
    logp3, _ = token_logprobs_and_entropy(hidden, head, torch.tensor([[1]]), temperature=2.0)
    assert float(logp3) == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))))


def test_unknown_algorithm_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
        micro_batch_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), algorithm="ppo")
