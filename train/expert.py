"""Expert parallelism (`train.ep`): each MoE layer's experts split over a group of ep ranks.

The layout follows torchtitan's expert-parallel design. The trainer processes form a
(ep_replicate, ep) mesh, ep consecutive ranks to a group. Every stacked expert tensor of
transformers' MoE families ([experts, ...]: Qwen3-MoE's and Mixtral's `gate_up_proj` and
`down_proj`) becomes a DTensor with placements (Replicate, Shard(0)): rank i of a group holds
experts [i * E/ep, (i+1) * E/ep) in full, and FSDP2 (train/parallel.py) shards everything else
over all ranks while leaving these tensors alone (`ignored_params`).

A layer's forward on each rank, for its own tokens' top-k choices:
1. sort the (token, choice) pairs by expert; all_to_all_single of the per-expert counts tells
   each rank how many rows it receives from each peer;
2. dispatch: all_to_all_single (differentiable) moves each row to the rank owning its expert;
3. the rank runs its experts on the rows it received, grouped by local expert;
4. combine: the reverse all_to_all_single brings the outputs home, where they are weighted by
   the router and summed per token, as transformers' own forward does.

Gradients: a rank's expert gradient sums what the tokens of its whole EP group sent it. FSDP2
averages the other gradients over all W ranks of losses scaled by W / tokens (train/step.py),
so each layer's backward sums its expert gradients over the ep_replicate groups (ranks holding
the same experts) and divides by W: the same average, hence the same update as ep=1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn import functional as F

from train.config import check_ep_experts, check_ep_family, check_ep_world, model_experts
from train.distributed import DistInfo

EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def expert_modules(lm: nn.Module) -> list[nn.Module]:
    """The modules that hold a layer's experts as stacked [experts, ...] tensors."""
    return [m for m in lm.modules()
            if all(isinstance(getattr(m, n, None), nn.Parameter) and getattr(m, n).dim() == 3
                   for n in EXPERT_TENSORS) and isinstance(getattr(m, "num_experts", None), int)]


def expert_mesh(info: DistInfo, ep: int):
    """(ep_replicate, ep) over all ranks: ep consecutive ranks share one copy of every expert."""
    return init_device_mesh(info.device.type, (info.world_size // ep, ep), mesh_dim_names=("ep_replicate", "ep"))


def shard_experts(lm: nn.Module, info: DistInfo, ep: int) -> set[nn.Parameter]:
    """Collective: keep this rank's experts of every MoE layer (the rest is freed) and route each
    layer's tokens through all-to-all. Returns the expert parameters, which FSDP2 must ignore."""
    check_ep_world(ep, info.world_size)
    check_ep_experts(ep, model_experts(lm.config.to_dict()), info.world_size)
    check_ep_family(ep, getattr(lm.config, "model_type", None))
    modules = expert_modules(lm)
    if not modules:
        raise ValueError(f"train.ep={ep}: {type(lm).__name__} names experts in its config but holds none as "
                         f"stacked tensors ({', '.join(EXPERT_TENSORS)}); expert parallelism supports the MoE "
                         f"families that do (Qwen3-MoE, Mixtral); set train.ep=1")
    mesh = expert_mesh(info, ep)
    index = mesh.get_local_rank("ep")
    sharded: set[nn.Parameter] = set()
    replicas = mesh.get_group("ep_replicate") if mesh.size(0) > 1 else None
    for module in modules:
        per_rank = module.num_experts // ep
        for name in EXPERT_TENSORS:
            full = getattr(module, name)
            # A meta skeleton (sharded load) stays on meta: train/sharded.py fills this rank's experts.
            local = full.detach()[index * per_rank:(index + 1) * per_rank]
            local = local.clone() if full.is_meta else local.to(info.device).clone()
            param = nn.Parameter(DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False,
                                                    shape=full.shape, stride=full.stride()))
            setattr(module, name, param)
            sharded.add(param)
        module.forward = _ExpertParallelForward(module, mesh.get_group("ep"), ep, per_rank, replicas,
                                                info.world_size)
    return sharded


class _AverageGradient(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the world size and sums it over the
    ranks holding the same experts (None: no other replica). Part of the forward rather than a
    hook on the parameter, which to_empty (sharded load) would drop by replacing the parameter."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, replicas, world_size: int) -> torch.Tensor:
        ctx.replicas, ctx.world_size = replicas, world_size
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad / ctx.world_size
        if ctx.replicas is not None:
            dist.all_reduce(grad, group=ctx.replicas)
        return grad, None, None


def _all_to_all(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single of rows (backward sends the gradients the reverse way)."""
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    return all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)


class _ExpertParallelForward:
    """forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H] of one experts
    module, with its experts spread over the EP group (the signature of transformers' own)."""

    def __init__(self, module: nn.Module, group, ep: int, per_rank: int, replicas, world_size: int):
        self.module, self.group, self.ep, self.per_rank = module, group, ep, per_rank
        self.replicas, self.world_size = replicas, world_size

    def local(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _AverageGradient.apply(param.to_local(), self.replicas, self.world_size).to(dtype)

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        m, ep, per_rank = self.module, self.ep, self.per_rank
        k = top_k_index.shape[1]
        choice = top_k_index.reshape(-1)
        order = torch.argsort(choice, stable=True)          # (token, choice) pairs grouped by expert
        token = order // k
        with torch.no_grad():
            sent = torch.bincount(choice, minlength=m.num_experts)
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent, group=self.group)  # [peer, local expert] counts
        in_splits = sent.view(ep, per_rank).sum(1).tolist()
        out_splits = received.view(ep, per_rank).sum(1).tolist()
        rows = _all_to_all(hidden[token], out_splits, in_splits, self.group)
        # Rows arrive peer by peer, each peer's sorted by expert: regroup them by local expert.
        local_expert = torch.arange(per_rank, device=rows.device).repeat(ep).repeat_interleave(received.to(rows.device))
        by_expert = torch.argsort(local_expert, stable=True)
        counts = received.view(ep, per_rank).sum(0).tolist()
        gate_up, down = self.local(m.gate_up_proj, hidden.dtype), self.local(m.down_proj, hidden.dtype)
        outputs = []
        for e, x in enumerate(torch.split(rows[by_expert], counts)):
            gate, up = F.linear(x, gate_up[e]).chunk(2, dim=-1)
            outputs.append(F.linear(m.act_fn(gate) * up, down[e]))
        done = torch.cat(outputs)[torch.argsort(by_expert)]
        back = _all_to_all(done, in_splits, out_splits, self.group)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(hidden).index_add_(0, token, weighted.to(hidden.dtype))


def expert_writers(param: torch.Tensor) -> list[int] | None:
    """For a stacked expert tensor sharded by expert parallelism: the global rank that publishes
    each of its experts (the rank holding it in the first EP group); None for any other tensor."""
    if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names != ("ep_replicate", "ep"):
        return None
    ranks = param.device_mesh.mesh[0].tolist()
    per_rank = param.shape[0] // len(ranks)
    return [ranks[e // per_rank] for e in range(param.shape[0])]


def publishes_own_experts(param: torch.Tensor) -> bool:
    """Whether this rank writes the experts it holds of `param` (it is in the first EP group)."""
    return param.device_mesh.get_local_rank("ep_replicate") == 0


def expert_bytes(lm: nn.Module) -> int:
    """Bytes of expert weights this rank holds (its local shards under expert parallelism)."""
    total = 0
    for module in expert_modules(lm):
        for name in EXPERT_TENSORS:
            t = getattr(module, name)
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def expert_bytes_computing(lm: nn.Module) -> int:
    """Bytes of one MoE layer's expert weights this rank holds while the layer runs: all of them
    under FSDP2 alone (it all-gathers the layer's stacked experts for forward and backward), its
    own E/ep under expert parallelism (nothing is gathered)."""
    layers = [sum((t.to_local() if expert_writers(t) is not None else t).numel() * t.element_size()
                  for t in (getattr(m, n) for n in EXPERT_TENSORS)) for m in expert_modules(lm)]
    return max(layers, default=0)
