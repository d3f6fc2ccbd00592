"""The `train` config section: algorithm, parallelism, optimizer, schedule, retention.

Defaults are the GRPO settings FIELD-NOTES measured to learn on the tiny model: AdamW lr 2e-4,
ratio clip [0.8, 1.28], 4 optimizer steps per iteration, gradient clip 1, std-normalised
advantages, zero-std groups dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from coordination.config import ConfigError, non_negative, option, positive


@dataclass
class TrainConfig:
    """How the trainer turns an iteration's trajectories into the next checkpoint."""

    algorithm: Literal["grpo", "rft"] = option(
        "grpo", "grpo: group-relative advantages with a clipped importance ratio; "
                "rft: rejection sampling (SFT loss on samples with reward >= rft_min_reward)")
    backend: Literal["fsdp", "ddp"] = option(
        "fsdp", "data parallelism: fsdp (FSDP2, parameters sharded over ranks) or ddp (replicated)")
    lr: float = option(2e-4, "peak learning rate of AdamW")
    weight_decay: float = option(0.0, "AdamW decoupled weight decay")
    betas: list[float] = option(factory=lambda: [0.9, 0.999], help="AdamW betas [beta1, beta2]")
    adam_eps: float = option(1e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this value (0 = no clipping)")
    clip_low: float = option(0.2, "importance ratio is clipped below at 1 - clip_low")
    clip_high: float = option(0.28, "importance ratio is clipped above at 1 + clip_high")
    kl_coef: float = option(0.0, "weight of the KL penalty to the reference policy (0 = off, no reference model)")
    advantage_std_normalize: bool = option(
        True, "divide each group's advantages by the group's reward std (+ std_eps)")
    std_eps: float = option(1e-4, "added to the group std before dividing")
    steps_per_iteration: int = option(
        4, "optimizer steps per iteration: the iteration's samples are split into this many mini-batches")
    epochs: int = option(
        1, "passes over the iteration's samples; each pass is cut into steps_per_iteration / epochs mini-batches "
           "(1: every sample is used once; = steps_per_iteration: every step sees all samples)")
    micro_batch_tokens: int = option(
        8192, "token budget of one micro-batch (padded rows x longest row); bounds activation memory")
    lr_schedule: Literal["constant", "cosine"] = option(
        "constant", "learning-rate schedule over optimizer steps after warm-up")
    warmup_steps: int = option(0, "optimizer steps of linear warm-up from 0 to lr")
    lr_decay_steps: int = option(
        0, "cosine only: optimizer steps (counted over the whole run) over which lr decays to lr_min_ratio * lr")
    lr_min_ratio: float = option(0.1, "cosine only: final lr as a fraction of lr")
    max_attempts: int = option(2, "the driver retries a failed training attempt up to this many attempts in total")
    keep_last: int = option(3, "retention: keep the last K checkpoints (plus eval iterations and the one in use)")
    nproc_per_node: int = option(1, "trainer processes per node (one per GPU on GPU nodes)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "compute dtype; auto = float32 on CPU, bfloat16 on CUDA. Master weights and "
                "optimizer state stay float32")
    seed: int = option(0, "seed for data order and torch; combined with the iteration number")
    rft_min_reward: float = option(1.0, "rft: a sample is kept when its reward is at least this")
    collective_timeout: float = option(
        600.0, "seconds a trainer rank waits in one collective (a dead peer is reported after this at most)")

    def __post_init__(self) -> None:
        positive(self.lr, "train.lr")
        non_negative(self.weight_decay, "train.weight_decay")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), like [0.9, 0.999] (got {self.betas!r})")
        positive(self.adam_eps, "train.adam_eps")
        non_negative(self.grad_clip, "train.grad_clip")
        if not 0 <= self.clip_low < 1:
            raise ConfigError(f"train.clip_low must be in [0, 1) so that 1 - clip_low stays positive "
                              f"(got {self.clip_low!r}); 0.2 is usual")
        non_negative(self.clip_high, "train.clip_high")
        non_negative(self.kl_coef, "train.kl_coef")
        positive(self.std_eps, "train.std_eps")
        if self.steps_per_iteration < 1:
            raise ConfigError(f"train.steps_per_iteration must be at least 1 (got {self.steps_per_iteration})")
        if self.epochs < 1 or self.steps_per_iteration % self.epochs:
            raise ConfigError(f"train.epochs must be at least 1 and divide train.steps_per_iteration "
                              f"(got epochs={self.epochs}, steps_per_iteration={self.steps_per_iteration})")
        if self.micro_batch_tokens < 16:
            raise ConfigError(f"train.micro_batch_tokens must be at least 16 (got {self.micro_batch_tokens}); "
                              f"it must hold the longest prompt + completion")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be zero or positive (got {self.warmup_steps})")
        if self.lr_schedule == "cosine" and self.lr_decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"train.lr_schedule=cosine needs train.lr_decay_steps > train.warmup_steps "
                f"(got lr_decay_steps={self.lr_decay_steps}, warmup_steps={self.warmup_steps}); set lr_decay_steps "
                f"to the run's total optimizer steps (iterations x steps_per_iteration)")
        if not 0 <= self.lr_min_ratio <= 1:
            raise ConfigError(f"train.lr_min_ratio must be in [0, 1] (got {self.lr_min_ratio!r})")
        if self.max_attempts < 1:
            raise ConfigError(f"train.max_attempts must be at least 1 (got {self.max_attempts})")
        if self.keep_last < 1:
            raise ConfigError(f"train.keep_last must be at least 1 (got {self.keep_last}); the newest "
                              f"checkpoint is always needed to continue")
        if self.nproc_per_node < 1:
            raise ConfigError(f"train.nproc_per_node must be at least 1 (got {self.nproc_per_node})")
        positive(self.collective_timeout, "train.collective_timeout")
