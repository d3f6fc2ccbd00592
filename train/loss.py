"""Per-token log-probabilities and the policy losses.

Kept apart from the model and the parallelism so that a chunked LM head, a different loss or a
KL estimator is a change in one function. Every loss here is per token; the trainer sums it over
the completion tokens of a micro-batch and divides by the completion-token count of the whole
optimizer step on all ranks (token-level normalisation over the global batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from train.config import CLIP_HIGH, CLIP_LOW


def token_logprobs_and_entropy(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                               temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy of the sampling distribution softmax(head(hidden) / T).

    hidden [B, T, H] are the states that predict targets [B, T]. The same temperature scaling as
    the sampler's (rollout/engine.py) makes the logprobs comparable with the sampling logprobs.
    Entropy is a diagnostic and carries no gradient."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    with torch.no_grad():
        entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                        clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO per-token loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp - old_logp).

    Returns (loss, clipped): `clipped` marks tokens where the clipped term is the smaller one,
    i.e. where clipping removes the token's gradient (the usual clip fraction)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


def sft_loss(logp: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token (SFT and rejection sampling)."""
    return -logp


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens: exp(d) - d - 1, d = ref - logp.
    Non-negative and unbiased (Schulman's k3)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


@dataclass
class LossParts:
    """Sums over the masked tokens of one micro-batch (the trainer divides by the global count)."""

    loss: torch.Tensor          # carries the gradient
    clipped: float
    kl: float
    entropy: float


def micro_batch_loss(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, *, algorithm: str,
                     old_logp: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                     ref_logp: torch.Tensor | None = None, clip_low: float = CLIP_LOW, clip_high: float = CLIP_HIGH,
                     kl_coef: float = 0.0) -> LossParts:
    """Masked sums of the per-token loss of `algorithm` ("grpo", "rft" or "sft")."""
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    if algorithm == "grpo":
        if old_logp is None or advantages is None:
            raise ValueError("grpo needs the sampling logprobs and the advantages")
        per_token, clipped = clipped_policy_loss(logp, old_logp, advantages, clip_low=clip_low, clip_high=clip_high)
    elif algorithm in ("rft", "sft"):
        per_token = sft_loss(logp)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}; use grpo, rft or sft")
    kl_sum = 0.0
    if kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    return LossParts(loss=(per_token * mask).sum(), clipped=float((clipped.float() * mask).sum()),
                     kl=kl_sum, entropy=float((entropy * mask).sum()))
