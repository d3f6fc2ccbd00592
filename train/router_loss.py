"""The load-balancing auxiliary loss of a mixture-of-experts model, over the global micro-batch.

transformers' MoE families (Qwen3-MoE, Mixtral) define it in `load_balancing_loss_func` (the
Switch Transformer loss) and add `router_aux_loss_coef * aux` to the language-model loss when the
config says `output_router_logits: true`. Over the L layers' router logits of N unpadded tokens:

    f_e = C_e / R,  P_e = S_e / R,  aux = E * sum_e f_e * P_e

with C_e the number of top-k choices of expert e, S_e the sum of the router's softmax
probability of e, both summed over layers and tokens, and R = L * N. The model computes it over
the batch of one forward. Here a micro-batch is split over the trainer ranks (and under expert
parallelism the router runs on each token's own rank), so C, S and R are summed over all ranks
first: every rank sees the aux loss of the global micro-batch, whatever the number of ranks or
`train.ep`. Only S depends on the weights (C counts an argmax), so rank r's share of the
gradient is that of E * sum_e f_e * S_e^r / R, its local probability sums; the shares of all
ranks add up to d(aux). train/step.py scales the share like the token loss (by the world size,
which FSDP2's gradient average divides out) and by 1 / micro-batches: the step's aux loss is the
mean over its micro-batches.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from train.config import model_experts
from train.expert import expert_modules


@dataclass
class AuxLoss:
    value: torch.Tensor        # the global micro-batch's aux loss (no gradient)
    local_share: torch.Tensor  # this rank's differentiable share; the shares of all ranks sum to `value`


class RouterLoss:
    """Forward hooks on every router of `lm` record its logits while `capture()` is open (not in
    a checkpointed block's recomputation, which runs in backward); `take` turns them into the aux
    loss and forgets them."""

    def __init__(self, lm: nn.Module, routers: list[nn.Module]):
        config = lm.config
        self.coef = float(config.router_aux_loss_coef)
        self.num_experts = _num_experts(config)
        self.top_k = int(config.num_experts_per_tok)
        self.layers = len(routers)
        self._logits: list[torch.Tensor] = []
        self._open = False
        for router in routers:
            router.register_forward_hook(self._record)

    @classmethod
    def for_model(cls, lm: nn.Module) -> "RouterLoss | None":
        """The aux loss `lm` defines: None for a dense model or one whose config does not ask for
        it (`output_router_logits` false: transformers adds nothing to its loss then either)."""
        if not getattr(lm.config, "output_router_logits", False):
            return None
        routers = router_modules(lm)
        if not routers:
            raise ValueError(f"{type(lm).__name__}'s config sets output_router_logits but the model has no "
                             f"router next to stacked experts; the load-balancing loss supports the MoE "
                             f"families that do (Qwen3-MoE, Mixtral); set output_router_logits to false")
        return cls(lm, routers)

    def _record(self, module: nn.Module, args, output) -> None:
        if self._open:
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    @contextlib.contextmanager
    def capture(self):
        self._logits.clear()
        self._open = True
        try:
            yield
        finally:
            self._open = False

    def take(self, attention_mask: torch.Tensor, group=None) -> AuxLoss:
        """Collective over `group` (None: all ranks, when the process group exists): the aux loss
        of the logits recorded by the last `capture()`, padding (attention_mask 0) left out."""
        logits, self._logits = self._logits, []
        if len(logits) != self.layers:
            raise RuntimeError(f"recorded {len(logits)} router outputs in one forward, expected {self.layers} "
                               f"(one per MoE layer); was the forward run inside RouterLoss.capture()?")
        mask = attention_mask.reshape(-1).float()
        counts = torch.zeros(self.num_experts, dtype=torch.float32, device=mask.device)
        probs = torch.zeros(self.num_experts, dtype=torch.float32, device=mask.device)
        for layer in logits:
            p = torch.softmax(layer.float(), dim=-1)
            chosen = torch.topk(p, self.top_k, dim=-1).indices
            counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(self.top_k))
            probs = probs + (p * mask.unsqueeze(-1)).sum(0)
        rows = mask.sum() * self.layers
        totals = torch.cat([counts, probs.detach(), rows.reshape(1)])
        if dist.is_initialized():
            dist.all_reduce(totals, group=group)
        counts, global_probs, rows = totals[:self.num_experts], totals[self.num_experts:-1], totals[-1]
        if rows.item() == 0:
            zero = probs.sum() * 0
            return AuxLoss(zero.detach(), zero)
        f = counts / rows
        return AuxLoss(self.num_experts * (f * global_probs).sum() / rows,
                       self.num_experts * (f * probs).sum() / rows)


def router_modules(lm: nn.Module) -> list[nn.Module]:
    """The router (`gate`) of every sparse MoE block: the sibling of a stacked experts module."""
    experts = {id(m) for m in expert_modules(lm)}
    return [m.gate for m in lm.modules()
            if isinstance(getattr(m, "gate", None), nn.Module) and id(getattr(m, "experts", None)) in experts]


def _num_experts(config) -> int:
    n = model_experts(config.to_dict())
    if n is None:
        raise ValueError(f"{type(config).__name__} names no experts; the load-balancing loss needs an MoE model")
    return n
