"""AdamW and the learning-rate schedule.

The schedule is a pure function of the run's optimizer step count, which `trainer_state.json`
carries from one iteration's torchrun to the next; so there is no scheduler object to save.
"""
from __future__ import annotations

import math

from train.config import TrainConfig


def lr_at(step: int, *, lr: float, schedule: str, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Learning rate of the optimizer step that follows `step` completed steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
        return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr schedule {schedule!r}; use constant or cosine")


def config_lr(cfg: TrainConfig, step: int) -> float:
    return lr_at(step, lr=cfg.lr, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                 decay_steps=cfg.lr_decay_steps, min_ratio=cfg.lr_min_ratio)


def build_optimizer(params, cfg: TrainConfig):
    """AdamW over `params` (plain or DTensor parameters; foreach kernels on both)."""
    import torch

    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
