"""One optimizer step over a rank's micro-batches, shared by the RL trainer and SFT.

Token-level normalisation over the global batch: each micro-batch's summed per-token loss is
divided by the number of completion tokens of the whole step on all ranks. DDP and FSDP2 average
gradients over ranks, so the loss is also multiplied by the world size; the gradient is then
exactly d(sum of all token losses / global tokens), whatever the number of ranks or micro-batches.
1 process and N processes on the same global batch make the same update (up to float summation
order), and DDP and FSDP2 agree. A mixture-of-experts model that asks for its load-balancing loss
adds `router_aux_loss_coef` times the mean over micro-batches of each global micro-batch's aux
loss (train/router_loss.py), to the gradient and to the logged loss; `aux_loss` logs the aux
loss itself. Under context parallelism (train/context.py) each rank of a CP group sums the loss
of its own slice of the group's micro-batch: over all ranks every token is still counted once, so
the same scale holds; the micro-batch's token counts are counted by the group's first rank only.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from train.batches import MicroBatch
from train.config import CLIP_HIGH, CLIP_LOW
from train.distributed import DistInfo, all_reduce_max, all_reduce_sum
from train.loss import micro_batch_loss
from train.memory import peak_rss_mb
from train.optim import set_lr
from train.parallel import accumulation_context, clip_grad_norm, compute_context
from train.router_loss import RouterLoss


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm; every rank sees the same global value and stops."""


@dataclass
class StepSettings:
    algorithm: str                 # grpo | rft | sft
    backend: str                   # fsdp | ddp
    dtype: torch.dtype
    temperature: float = 1.0
    clip_low: float = CLIP_LOW
    clip_high: float = CLIP_HIGH
    kl_coef: float = 0.0
    grad_clip: float = 1.0


@dataclass
class StepMetrics:
    loss: float
    entropy: float
    clip_fraction: float
    kl: float
    grad_norm: float
    lr: float
    tokens: int
    completion_tokens: int
    seconds: float
    tokens_per_s: float
    peak_memory_mb: float          # the highest of all ranks (what the log line shows)
    local_peak_memory_mb: float    # this rank's own
    aux_loss: float = 0.0          # the load-balancing loss of an MoE model that asks for it (unscaled)

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self, label: str) -> str:
        return (f"{label} loss {self.loss:.4f} entropy {self.entropy:.3f} clip {self.clip_fraction:.3f} "
                f"kl {self.kl:.4f} grad_norm {self.grad_norm:.3f} lr {self.lr:.2e} tokens {self.tokens} "
                f"tok/s {self.tokens_per_s:,.0f} peak_mem {self.peak_memory_mb:,.0f} MB"
                + (f" aux {self.aux_loss:.4f}" if self.aux_loss else ""))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory of this step on CUDA; the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mb()


def train_step(model: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
               micro_batches: list[MicroBatch], *, global_completion_tokens: int, lr: float,
               settings: StepSettings, info: DistInfo, reference: nn.Module | None = None,
               router_loss: RouterLoss | None = None) -> StepMetrics:
    """Forward/backward every micro-batch, clip, AdamW step. Collective: all ranks call it with
    the same number of micro-batches. `router_loss`: the MoE model's load-balancing loss, if any."""
    if global_completion_tokens <= 0:
        raise ValueError("a step needs at least one completion token on some rank")
    set_lr(optimizer, lr)
    reset_peak_memory(info.device)
    start = time.perf_counter()
    scale = info.world_size / global_completion_tokens
    sums = {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "entropy": 0.0, "tokens": 0.0, "completion_tokens": 0.0}
    aux_sum = 0.0
    cp = getattr(getattr(model, "module", model), "context", None)
    for k, mb in enumerate(micro_batches):
        mb = mb.to(info.device)
        per_token = mb.loss_mask, mb.old_logprobs, mb.advantages
        if cp is not None:
            per_token = tuple(cp.predictions(t) for t in per_token)
        loss_mask, old_logprobs, advantages = per_token
        with accumulation_context(model, settings.backend, last=k == len(micro_batches) - 1):
            with compute_context(settings.backend, settings.dtype, info.device):
                with router_loss.capture() if router_loss is not None else contextlib.nullcontext():
                    logp, entropy = model(mb.input_ids, mb.attention_mask, mb.targets, settings.temperature)
                ref_logp = None
                if reference is not None:
                    with torch.no_grad():
                        ref_logp, _ = reference(mb.input_ids, mb.attention_mask, mb.targets, settings.temperature)
                parts = micro_batch_loss(logp.float(), entropy.float(), loss_mask, algorithm=settings.algorithm,
                                         old_logp=old_logprobs, advantages=advantages,
                                         ref_logp=None if ref_logp is None else ref_logp.float(),
                                         clip_low=settings.clip_low, clip_high=settings.clip_high,
                                         kl_coef=settings.kl_coef)
            total_loss = parts.loss * scale
            if router_loss is not None:
                aux = router_loss.take(mb.attention_mask)
                aux_sum += float(aux.value)
                if router_loss.coef:
                    share = router_loss.coef * info.world_size / len(micro_batches)
                    total_loss = total_loss + aux.local_share * share
            total_loss.backward()
        sums["loss"] += float(parts.loss.detach())
        sums["clipped"] += parts.clipped
        sums["kl"] += parts.kl
        sums["entropy"] += parts.entropy
        if cp is None or cp.index == 0:
            sums["tokens"] += mb.tokens if mb.completion_tokens else 0
            sums["completion_tokens"] += mb.completion_tokens
    grad_norm = clip_grad_norm(params, settings.grad_clip)
    if not math.isfinite(grad_norm):
        raise TrainingDiverged(f"gradient norm is {grad_norm} (lr {lr:.2e}); the update was not applied. "
                               f"Lower train.lr or check the trajectories for extreme logprobs")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    keys = list(sums)
    total = dict(zip(keys, all_reduce_sum([sums[k] for k in keys], info.device)))
    local_peak = peak_memory_mb(info.device)
    seconds, peak = all_reduce_max([seconds, local_peak], info.device)
    n = max(total["completion_tokens"], 1.0)
    # Every rank holds the same global aux values: no reduction.
    aux_loss = aux_sum / len(micro_batches)
    coef = router_loss.coef if router_loss is not None else 0.0
    return StepMetrics(loss=total["loss"] / n + coef * aux_loss, entropy=total["entropy"] / n,
                       clip_fraction=total["clipped"] / n, kl=total["kl"] / n, grad_norm=grad_norm, lr=lr,
                       tokens=int(total["tokens"]), completion_tokens=int(total["completion_tokens"]), seconds=seconds,
                       tokens_per_s=total["tokens"] / max(seconds, 1e-9), peak_memory_mb=peak,
                       local_peak_memory_mb=local_peak, aux_loss=aux_loss)
