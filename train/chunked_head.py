"""Per-token logprobs and entropy of the sampled tokens without the [tokens, vocab] logits.

The plain path (train/loss.py) computes head(hidden) for every token at once and keeps the
logits, their softmax and their gradient alive: 4,096 tokens x a 152k vocabulary is 2.5 GB in
float32 per tensor, the largest allocation of a step. Here an autograd function walks the tokens
in chunks: forward keeps only each token's log-normaliser (one float); backward recomputes one
chunk's logits at a time and turns them into that chunk's gradients for the hidden states and
the head weight. Peak memory of the head is then a few chunks of logits, whatever the number of
tokens, for one extra head matmul per chunk in backward.

The arithmetic follows the plain path step for step (logits in the compute dtype, then float32,
divided by the temperature), so values and gradients agree within float rounding.
"""
from __future__ import annotations

import torch

# `auto` aims at about this many float32 logits per chunk (64 MiB: 512 tokens of a 32k vocabulary,
# 128 of a 152k one), within the bounds below; a GPU matmul of that size is still efficient.
_AUTO_ELEMENTS = 2**24
_AUTO_MIN, _AUTO_MAX = 128, 8192


def resolve_chunk_size(setting: int | str, vocab_size: int) -> int | None:
    """Tokens per chunk for train.fused_lm_head_token_chunk_size; None = the plain path."""
    if setting == "disabled":
        return None
    if setting == "auto":
        tokens = _AUTO_ELEMENTS // max(1, vocab_size)
        return max(_AUTO_MIN, min(_AUTO_MAX, tokens // 64 * 64 or _AUTO_MIN))
    return int(setting)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the plain path's head matmul would run in (autocast's, when autocast is on)."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden)
        n = hidden.shape[0]
        # Allocated in the output shape and written through flat views: FSDP2 warns about outputs
        # that are views (an in-place op on one would skip its backward hook).
        logp_out = torch.empty(shape, dtype=torch.float32, device=hidden.device)
        entropy_out = torch.empty(shape, dtype=torch.float32, device=hidden.device)
        logp, entropy = logp_out.view(-1), entropy_out.view(-1)
        log_z = torch.empty(n, dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                logits = (hidden[start:end].to(dtype) @ w.t()).float()
                if temperature != 1.0:
                    logits = logits / temperature
                lz = torch.logsumexp(logits, dim=-1)
                log_z[start:end] = lz
                logp[start:end] = logits.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1) - lz
                entropy[start:end] = lz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
                del logits
        ctx.save_for_backward(hidden, weight, targets, log_z)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.mark_non_differentiable(entropy_out)
        return logp_out, entropy_out

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, _grad_entropy: torch.Tensor):
        hidden, weight, targets, log_z = ctx.saved_tensors
        dtype, temperature, chunk = ctx.dtype, ctx.temperature, ctx.chunk
        grad_logp = grad_logp.reshape(-1)
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                end = min(hidden.shape[0], start + chunk)
                h = hidden[start:end].to(dtype)
                logits = (h @ w.t()).float()
                if temperature != 1.0:
                    logits = logits / temperature
                # d logp / d logits = onehot(target) - softmax(logits), then through the 1/T scaling.
                grad = torch.exp(logits - log_z[start:end, None]).neg_()
                del logits
                grad.scatter_add_(-1, targets[start:end, None], torch.ones_like(grad[:, :1]))
                grad.mul_(grad_logp[start:end, None].float() / temperature)
                grad = grad.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:end] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    # In place with the cast on the fly: no float32 copy of the [V, h] product.
                    grad_weight.add_(grad.t() @ h)
                del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_logprobs_and_entropy(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                                 temperature: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as train.loss.token_logprobs_and_entropy: hidden [B, T, H], targets [B, T]
    -> (logp, entropy) [B, T] in float32; entropy carries no gradient."""
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ValueError(f"the chunked LM head needs a bias-free nn.Linear output layer, not {type(head).__name__}; "
                         f"set train.fused_lm_head_token_chunk_size=disabled (or keep lm_head out of "
                         f"train.lora.target_modules)")
    b, t, h = hidden.shape
    return _ChunkedLogprobs.apply(hidden.reshape(b * t, h), head.weight, targets.reshape(b * t), float(temperature),
                                  int(chunk), (b, t))
