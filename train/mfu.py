"""Model FLOPs utilisation: the FLOPs a training step must do, over what the hardware could do.

flops per token = 6 x N + 12 x layers x heads x head_dim x sequence length, where N counts the
parameters of every matrix multiply (the linear layers of the blocks and the LM head, also when
it is tied to the embedding; not the embedding lookup): 2 FLOPs per weight in forward and 4 in
backward, plus the attention scores and their weighted sum, which grow with the sequence
(PaLM appendix B). Recomputation (activation checkpointing) is not counted: MFU measures useful
work, so checkpointing lowers it.

MFU = flops per token x tokens/s / (peak FLOP/s per device x devices). The peaks are the dense
bfloat16 tensor-core figures of NVIDIA's data sheets; elsewhere (other GPUs, CPUs) MFU needs the
peak from the user (`--bench-peak-tflops`).
"""
from __future__ import annotations

from torch import nn

# Dense bfloat16 TFLOP/s per GPU, by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("A100", 312.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
]


def matmul_parameters(lm: nn.Module) -> int:
    """Weights of every nn.Linear in `lm` (a tied LM head counts: its matmul is done)."""
    return sum(m.weight.numel() for m in lm.modules() if isinstance(m, nn.Linear))


def flops_per_token(lm: nn.Module, seq_len: int) -> float:
    cfg = lm.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 6.0 * matmul_parameters(lm) + 12.0 * cfg.num_hidden_layers * heads * head_dim * seq_len


def device_peak_tflops(device_name: str) -> float | None:
    """The bf16 peak of a known GPU (by name), or None."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def mfu(flops_token: float, tokens_per_s: float, peak_tflops: float | None, world_size: int) -> float | None:
    """Fraction of the peak (0..1), or None without a peak."""
    if not peak_tflops:
        return None
    return flops_token * tokens_per_s / (peak_tflops * 1e12 * world_size)
