"""From config to the module the trainer differentiates: every memory and speed lever is an option here.

The order is the one FSDP2 recipes use (torchtitan): load the model with its attention
implementation -> LoRA adapters -> activation checkpointing per decoder block -> torch.compile per
block -> FSDP2 or DDP -> optimizer (and optimizer-state offload). The RL trainer, SFT and the
`--bench` mode of both build through here, so a lever behaves the same everywhere.

`load_model` is each rank's local work (it may fail: run it inside `distributed.agreed`);
`make_trainable` is collective.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordination.config import ConfigError
from train.act_checkpoint import apply_activation_checkpointing
from train.chunked_head import resolve_chunk_size
from train.config import CompileConfig, TrainConfig, check_world_size
from train.context import enable_context_parallel
from train.distributed import DistInfo
from train.lora import WeightsSource, inject_adapters, merge_sources, weights_source
from train.model import Policy, compute_dtype, decoder_blocks, load_causal_lm, trainable_parameters
from train.offload import ActivationOffload, OptimizerStateOffload
from train.optim import build_optimizer
from train.parallel import apply_parallelism
from train.router_loss import RouterLoss
from train.sharded import build_on_meta, can_load_sharded, materialize, missing_names

_log = logging.getLogger("baton.train.build")


def preflight(cfg: TrainConfig, info: DistInfo) -> None:
    """Checks of the config against this machine and launch; ConfigError says what to change."""
    if cfg.attn == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(f"train.attn=flash_attention_2 needs the flash-attn package, which is not installed for "
                              f"{sys.executable}: install it on every GPU node (pip install -r requirements-gpu.txt, "
                              f"or pip install flash-attn --no-build-isolation) or set train.attn=sdpa")
        if info.device.type != "cuda":
            raise ConfigError(f"train.attn=flash_attention_2 runs on CUDA GPUs only, but this trainer runs on "
                              f"{info.device.type}; set train.attn=sdpa")
        if compute_dtype(cfg.dtype, info.device) == torch.float32:
            raise ConfigError("train.attn=flash_attention_2 computes in bfloat16 or float16 but train.dtype=float32; "
                              "set train.dtype=auto (bfloat16 on CUDA) or bfloat16, or use train.attn=sdpa")
    if cfg.backend == "fsdp":
        check_world_size(cfg.dp_replicate, info.world_size)


@dataclass
class Loaded:
    lm: nn.Module
    weights: WeightsSource
    sharded: bool = False  # parameters on the meta device until make_trainable fills this rank's shard
    extra: dict[str, torch.Tensor] | None = None  # sharded: full values of parameters not in the files (LoRA)


def meta_skeleton(folder: Path, attn: str) -> nn.Module | None:
    """`folder`'s model with its parameters on the meta device when its safetensors files hold every
    parameter under the model's own names, else None (the caller loads it whole: .bin weights, or
    names that only transformers' loading converts)."""
    if not can_load_sharded(folder):
        return None
    skeleton = build_on_meta(folder, attn)
    missing = missing_names(skeleton, folder)
    if not missing:
        return skeleton
    _log.warning("loading the whole model on every rank: %s stores weights under other names than the "
                 "model's parameters (e.g. %s), which only transformers' own loading converts", folder, missing[0])
    return None


def load_model(cfg: TrainConfig, source: Path, trainer_state: dict[str, Any] | None) -> Loaded:
    """This rank's copy of the weights to train (with LoRA adapters injected when configured).

    With safetensors weights the model is only a skeleton on the meta device here; make_trainable
    fills each rank's shard after FSDP2 (docs/design.md §11.4). LoRA adapters are injected into the
    skeleton and get host memory and their values (fresh, or the checkpoint's) at once: they are
    small, and each rank later keeps its slice."""
    weights = weights_source(cfg.lora, Path(source), trainer_state)
    lm = meta_skeleton(weights.base, cfg.attn)
    sharded = lm is not None
    if lm is None:
        lm = load_causal_lm(weights.base, cfg.attn)
    if cfg.lora.rank:
        inject_adapters(lm, cfg.lora, weights.adapter)
        if cfg.lora.publish == "merged":
            merge_sources(lm)   # refuses adapters it could not merge now, not after training
    extra = {n: p.detach().clone() for n, p in lm.named_parameters() if not p.is_meta} if sharded else None
    return Loaded(lm, weights, sharded=sharded, extra=extra or None)


def load_reference(cfg: TrainConfig, folder: Path) -> Loaded:
    """The frozen reference model of the KL penalty (the run's base model), loaded as load_model
    loads the policy: a meta skeleton whose shards make_reference fills, when the files allow."""
    weights = WeightsSource(Path(folder), None, False, None)
    lm = meta_skeleton(weights.base, cfg.attn)
    if lm is not None:
        return Loaded(lm, weights, sharded=True)
    return Loaded(load_causal_lm(weights.base, cfg.attn), weights)


@dataclass
class Trainable:
    policy: Any                     # train.model.Policy: owns the (sharded) parameters under HF names
    model: nn.Module                # what forward/backward call: the FSDP2 root or the DDP wrapper
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]      # trained parameters (LoRA: the adapters only)
    dtype: torch.dtype
    weights: WeightsSource
    checkpointed_blocks: int
    activation_offload: ActivationOffload | None
    optimizer_offload: OptimizerStateOffload | None
    router_loss: RouterLoss | None = None  # an MoE model's load-balancing loss, when its config asks for it


def compile_blocks(blocks: list[nn.Module], cfg: CompileConfig) -> None:
    """torch.compile each block's forward (after checkpointing, so the checkpoint is compiled with
    it). The forward, not the module, is compiled: FSDP2's hooks around it stay eager."""
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=cfg.fullgraph)


def make_policy(lm: nn.Module, cfg: TrainConfig, info: DistInfo, *, trainable: bool):
    """Policy with the per-block levers applied (before parallelism). Returns (policy, blocks checkpointed,
    activation offload)."""
    blocks = decoder_blocks(lm)
    checkpointed = 0
    if trainable:
        checkpointed = apply_activation_checkpointing(blocks, freq=cfg.ac.freq, mode=cfg.ac.mode,
                                                      targets=cfg.ac.targets)
    if cfg.compile is not None:
        compile_blocks(blocks, cfg.compile)
    head = lm.get_output_embeddings()
    chunk = resolve_chunk_size(cfg.fused_lm_head_token_chunk_size, head.weight.shape[0])
    if chunk is not None and (type(head) is not nn.Linear or head.bias is not None):
        raise ConfigError(f"train.fused_lm_head_token_chunk_size needs a bias-free linear LM head, but this model's "
                          f"is {type(head).__name__}; set train.fused_lm_head_token_chunk_size=disabled (or keep "
                          f"lm_head out of train.lora.target_modules)")
    offload = ActivationOffload(cfg.ac_offloading.max_inflight_activations, info.device) \
        if trainable and cfg.ac_offloading.enabled else None
    context = enable_context_parallel(lm, info, cfg.cp, cfg.attn, cfg.cp_kind) if cfg.cp > 1 else None
    return Policy(lm, head_chunk=chunk, activation_offload=offload, context=context), checkpointed, offload


def parallelize(policy, cfg: TrainConfig, info: DistInfo, dtype: torch.dtype) -> nn.Module:
    return apply_parallelism(policy, cfg.backend, info, dtype, reshard_after_forward=cfg.reshard_after_forward,
                             dp_replicate=cfg.dp_replicate if cfg.backend == "fsdp" else 1,
                             cpu_offload=cfg.fsdp_cpu_offload, ep=cfg.ep)


def parallelize_loaded(policy, loaded: Loaded, cfg: TrainConfig, info: DistInfo, dtype: torch.dtype) -> nn.Module:
    """Collective: parallelize `policy` (built on `loaded.lm`) and, for a sharded load, fill its
    parameters: after FSDP2 each rank reads only its shards; DDP replicates, so every rank reads
    all of it before wrapping."""
    if loaded.sharded and cfg.backend != "fsdp":
        materialize(policy, loaded.weights.base, info.device, loaded.extra)
    model = parallelize(policy, cfg, info, dtype)
    if loaded.sharded and cfg.backend == "fsdp":
        # FSDP2's CPU offload keeps the shards in host memory; otherwise they live on the device.
        device = torch.device("cpu") if cfg.fsdp_cpu_offload else info.device
        materialize(policy, loaded.weights.base, device, loaded.extra)
    return model


def make_trainable(loaded: Loaded, cfg: TrainConfig, info: DistInfo) -> Trainable:
    """Collective: apply the levers and the parallelism, build the optimizer."""
    dtype = compute_dtype(cfg.dtype, info.device)
    policy, checkpointed, act_offload = make_policy(loaded.lm, cfg, info, trainable=True)
    model = parallelize_loaded(policy, loaded, cfg, info, dtype)
    # The dtype a checkpoint of this policy is published in (train/export.py): what it computes in.
    policy.serving_dtype = dtype
    params = trainable_parameters(policy)
    optimizer = build_optimizer(params, cfg)
    opt_offload = OptimizerStateOffload(optimizer, info.device) if cfg.optim_cpu_offload else None
    if info.is_main:
        levers = [f"{len(params)} trained tensors ({sum(p.numel() for p in params):,} values)"]
        if cfg.lora.rank:
            levers.append(f"LoRA r={cfg.lora.rank} on {','.join(cfg.lora.target_modules)}")
        if checkpointed:
            levers.append(f"activation checkpointing ({cfg.ac.mode}) on {checkpointed} blocks")
        if act_offload:
            levers.append("activation offloading")
        if policy.head_chunk:
            levers.append(f"chunked LM head ({policy.head_chunk} tokens)")
        if cfg.compile is not None:
            levers.append("torch.compile per block")
        if cfg.backend == "fsdp" and cfg.dp_replicate > 1:
            levers.append(f"HSDP {cfg.dp_replicate}x{info.world_size // cfg.dp_replicate}")
        if cfg.cp > 1:
            groups = info.world_size // cfg.cp
            levers.append(f"context parallelism ({cfg.cp_kind}): {groups} group(s) of cp={cfg.cp} ranks")
        if cfg.ep > 1:
            levers.append(f"expert parallelism: {info.world_size // cfg.ep} group(s) of ep={cfg.ep} ranks")
        if cfg.fsdp_cpu_offload or cfg.optim_cpu_offload:
            levers.append("FSDP CPU offload" if cfg.fsdp_cpu_offload else "optimizer state on CPU")
        _log.info("model: %s", "; ".join(levers))
    return Trainable(policy, model, optimizer, params, dtype, loaded.weights, checkpointed, act_offload, opt_offload,
                     RouterLoss.for_model(loaded.lm))


def make_reference(loaded: Loaded, cfg: TrainConfig, info: DistInfo, dtype: torch.dtype) -> nn.Module:
    """Collective: the frozen reference policy of the KL penalty (from load_reference): same
    parallelism and LM head, no training levers."""
    loaded.lm.requires_grad_(False)
    policy, _, _ = make_policy(loaded.lm, cfg, info, trainable=False)
    model = parallelize_loaded(policy, loaded, cfg, info, dtype)
    return model.eval()
