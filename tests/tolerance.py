"""Float32 tolerances derived from the arithmetic, for comparing two evaluations of the same math.

Two float32 evaluations of one formula that add their terms in another order (another CPU's
matmul blocking, a chunked LM head, a recomputed activation, an all-reduce tree) differ by their
rounding errors, not by zero. For a sum of n terms x_i evaluated in float32, the rounding error
is at most about n·u·Σ|x_i| in the worst case and, with rounding errors that behave like
independent random variables, at most λ·√n·u·Σ|x_i| with probability at least 1 − 2·exp(−λ²/2)
(Higham and Mary, "A new approach to probabilistic rounding error analysis", SIAM J. Sci.
Comput. 2019). u = 2⁻²⁴ is float32's unit roundoff. We use the probabilistic bound with λ = 3:
the worst-case one is hundreds of times looser than anything seen, and a real lever bug (a lost
token, a wrong mask, a missed recomputation) moves a loss by 1e-3 or more.

The n of a model output is the length of the chain of reductions it passes through (each
layer's hidden and intermediate dot products, the vocabulary's log-sum-exp, the sum over
tokens); a gradient passes through that chain forward and backward.
"""
from __future__ import annotations

import math

UNIT_ROUNDOFF = 2.0 ** -24
LAMBDA = 3.0


def float32_tolerance(scale: float, length: int) -> float:
    """The largest difference two float32 evaluations of a length-`length` chain of reductions,
    whose terms add up in absolute value to `scale`, should show."""
    if scale < 0 or length < 1:
        raise ValueError(f"scale must be >= 0 and length >= 1 (got {scale}, {length})")
    return LAMBDA * math.sqrt(length) * UNIT_ROUNDOFF * scale


def forward_length(config, tokens: int) -> int:
    """Reductions from the input ids to a token-summed loss of a decoder-only `config`."""
    per_layer = config.hidden_size + config.intermediate_size
    return config.num_hidden_layers * per_layer + config.hidden_size + config.vocab_size + tokens


def loss_tolerance(config, per_token_terms, tokens: int) -> float:
    """A token-summed loss: `per_token_terms` are the masked per-token losses being summed."""
    return float32_tolerance(float(per_token_terms.abs().sum()), forward_length(config, tokens))


def gradient_tolerance(config, largest_gradient: float, tokens: int) -> float:
    """Gradients of a token-summed loss: each entry adds `tokens` contributions of either sign,
    whose absolute sum is about √tokens times the largest entry (random signs), through the
    forward chain and back."""
    return float32_tolerance(largest_gradient * math.sqrt(tokens), 2 * forward_length(config, tokens))
