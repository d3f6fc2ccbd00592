"""The `train` config section: algorithm, parallelism, optimizer, schedule, retention, and the
memory and speed levers (FSDP2 options, activation checkpointing and offloading, optimizer
offload, chunked LM head, LoRA, torch.compile, attention implementation).

Defaults are the GRPO settings we measured to learn on the tiny model (docs/design.md §10.4): AdamW lr 2e-4,
ratio clip [0.8, 1.28], 4 optimizer steps per iteration, gradient clip 1, std-normalised
advantages, zero-std groups dropped. The levers default to off except the chunked LM head, which
gives the plain results (within 1e-5) in a fraction of the memory.

Checks that need the machine (is flash-attn installed? does dp_replicate divide the number of
trainer processes?) run when the trainer starts (train/build.py `preflight`), not here: a login
node without GPUs must still be able to read a config meant for GPU nodes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coordination.config import ConfigError, non_negative, option, positive, section
from rollout.model_config import model_experts
from train.context_rules import check_cp_levers

# GRPO's clip range (DAPO's asymmetric "clip higher"): the one place the defaults are written;
# train/step.py and train/loss.py take them from here.
CLIP_LOW, CLIP_HIGH = 0.2, 0.28

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
AC_NAMED_TARGETS = ("attention", "matmul")
# The MoE families expert parallelism is built and tested for (docs/design.md §7): their experts
# are two stacked tensors per layer and their checkpoint layout is in train/expert_layout.py.
EP_FAMILIES = ("qwen3_moe", "mixtral")


def check_world_size(dp_replicate: int, world_size: int) -> None:
    """HSDP arranges the trainer processes as dp_replicate x dp_shard: dp_replicate must divide them."""
    if dp_replicate < 1 or world_size % dp_replicate:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"train.dp_replicate={dp_replicate} does not divide the number of trainer processes "
                          f"({world_size} = nodes x train.nproc_per_node); HSDP arranges them as dp_replicate x "
                          f"dp_shard, so set train.dp_replicate to one of {divisors} (1 = plain FSDP)")


def check_ep_world(ep: int, world_size: int) -> None:
    """train.ep ranks form one EP group: ep must divide the number of trainer processes."""
    if world_size % ep:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"train.ep={ep} does not divide the number of trainer processes ({world_size} = nodes x "
                          f"train.nproc_per_node); set train.ep to one of {divisors}")


def check_ep_experts(ep: int, num_experts: int | None, world_size: int) -> None:
    """Every rank of an EP group holds num_experts / ep experts of each MoE layer (`num_experts`
    None: a dense model, which has no experts to split)."""
    if ep == 1:
        return
    if num_experts is None:
        raise ConfigError(f"train.ep={ep} shards the experts of a mixture-of-experts model, but this model is dense "
                          f"(its config names no experts); set train.ep=1")
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and world_size % d == 0]
        raise ConfigError(f"train.ep={ep} does not divide the model's {num_experts} experts per layer; every rank "
                          f"of an EP group holds num_experts / ep of them, so set train.ep to one of {divisors}")


def check_ep_family(ep: int, model_type: str | None) -> None:
    """Expert parallelism shards the families it was built and tested for (EP_FAMILIES)."""
    if ep > 1 and model_type not in EP_FAMILIES:
        raise ConfigError(f"train.ep={ep}: expert parallelism supports the model families {', '.join(EP_FAMILIES)}, "
                          f"not {model_type!r} (its MoE block's routing, shared experts or checkpoint layout are "
                          f"not covered); set train.ep=1 (FSDP2 then shards its experts like any weight)")


def check_ep_launch(cfg: "TrainConfig", num_nodes: int, model_path: str | Path = "") -> None:
    """train.ep against the job's trainer processes and, when this node can read it, the model's
    experts: what the trainer would refuse at phase 10, found at start (rl/validate's rule
    expert-parallel-degree; the trainer checks again once it has loaded the model)."""
    if cfg.ep == 1:
        return
    world = num_nodes * cfg.nproc_per_node
    check_ep_world(cfg.ep, world)
    config = Path(model_path) / "config.json" if str(model_path) else None
    if config is not None and config.is_file():
        model = json.loads(config.read_text())
        check_ep_experts(cfg.ep, model_experts(model), world)
        check_ep_family(cfg.ep, model.get("model_type"))


def check_ep_levers(cfg: "TrainConfig") -> None:
    """The levers expert parallelism combines with in this build: FSDP2 over a 1-D mesh, no LoRA,
    no FSDP2 CPU offload (the experts are sharded outside FSDP2, train/expert.py)."""
    if cfg.ep < 1:
        raise ConfigError(f"train.ep must be at least 1 (got {cfg.ep}); 1 = no expert parallelism")
    if cfg.ep == 1:
        return
    clashes = [f"{name}={value} ({why})" for name, value, ok, why in (
        ("train.backend", cfg.backend, cfg.backend == "fsdp", "the experts are sharded beside FSDP2, not DDP"),
        ("train.dp_replicate", cfg.dp_replicate, cfg.dp_replicate == 1,
         "HSDP's (replicate, shard) mesh beside the (ep_replicate, ep) mesh is not implemented"),
        ("train.fsdp_cpu_offload", cfg.fsdp_cpu_offload, not cfg.fsdp_cpu_offload,
         "FSDP2 offloads only what it shards, and the expert shards are outside it: not implemented"),
        ("train.lora.rank", cfg.lora.rank, not cfg.lora.rank,
         "LoRA on stacked experts is not implemented")) if not ok]
    if clashes:
        raise ConfigError(f"train.ep={cfg.ep} does not combine with {'; '.join(clashes)}; set train.ep=1 or "
                          f"train.backend=fsdp, train.dp_replicate=1, train.fsdp_cpu_offload=false, train.lora.rank=0")


@dataclass
class ActivationCheckpointConfig:
    """Recompute decoder blocks in backward instead of keeping their activations."""

    freq: int = option(0, "checkpoint every N-th decoder block (blocks 0, N, 2N, ...; 1 = every block); 0 = off")
    mode: Literal["full", "selective"] = option(
        "full", "full: a checkpointed block keeps only its input and is recomputed in backward; selective: it also "
                "keeps the outputs of the `targets` operators, which the recomputation then skips")
    targets: list[str] = option(
        factory=lambda: ["attention"],
        help="selective mode: operators whose outputs are kept: attention (the scaled-dot-product attention "
             "kernels), matmul (mm/addmm/bmm: the projections), or aten operators like aten.mm or aten.mm.default")

    def __post_init__(self) -> None:
        if self.freq < 0:
            raise ConfigError(f"freq must be 0 (off) or a positive block interval (got {self.freq})")
        bad = [t for t in self.targets if t not in AC_NAMED_TARGETS and not t.startswith("aten.")]
        if bad:
            raise ConfigError(f"targets {bad} are not operators; use attention, matmul, or aten operator "
                              f"names like aten.mm")
        if self.mode == "selective" and not self.targets:
            raise ConfigError("targets is empty but mode=selective keeps the outputs of the targets; name at least one "
                              "(e.g. [attention]) or use mode=full")


@dataclass
class ActivationOffloadingConfig:
    """Keep activations saved for backward in host memory (saved-tensor hooks)."""

    enabled: bool = option(
        False, "copy every activation saved for backward to host memory during forward and back during backward; "
               "combine with train.ac so that only block inputs remain to be copied")
    max_inflight_activations: int = option(
        5, "CUDA: copies to host memory in flight at once; a device tensor is freed when its copy completes, so "
           "more overlaps copying with compute and holds more device memory")

    def __post_init__(self) -> None:
        if self.max_inflight_activations < 1:
            raise ConfigError(f"max_inflight_activations must be at least 1 "
                              f"(got {self.max_inflight_activations})")


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft) instead of training every weight."""

    rank: int = option(0, "LoRA rank r; 0 = off (train every weight). Only the adapters train and have optimizer state")
    alpha: float = option(16.0, "LoRA scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = option(0.0, "dropout on the adapter input (0 keeps training deterministic)")
    target_modules: list[str] = option(
        factory=lambda: list(LORA_TARGETS),
        help="names of the linear layers that get adapters (peft target_modules), e.g. [q_proj, v_proj]")
    publish: Literal["merged", "adapters"] = option(
        "merged", "what checkpoints carry: merged (full weights with the adapters merged, served as they are, plus "
                  "the adapters in adapter/) or adapters (only adapter/: the engine serves the base model and swaps "
                  "in each iteration's adapter without a restart; with vLLM set inference.vllm.max_lora_rank)")

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"rank must be 0 (off) or positive (got {self.rank})")
        positive(self.alpha, "alpha")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"dropout must be in [0, 1) (got {self.dropout!r})")
        if self.rank and not self.target_modules:
            raise ConfigError("target_modules is empty; name the layers to adapt, e.g. [q_proj, v_proj]")


@dataclass
class CompileConfig:
    """torch.compile of each decoder block."""

    fullgraph: bool = option(False, "compile each block as one graph (an error instead of a graph break)")


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
    clip_low: float = option(CLIP_LOW, "importance ratio is clipped below at 1 - clip_low")
    clip_high: float = option(CLIP_HIGH, "importance ratio is clipped above at 1 + clip_high")
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
    resident: bool = option(
        True, "keep each node's trainer processes (torchrun, model, optimizer state) alive across iterations and "
              "give them each iteration's plan through the run folder; false starts torchrun anew every iteration "
              "(the reference behaviour, docs/design.md §2)")
    offload_between_iterations: bool = option(
        True, "resident trainer in a job whose inference engine shares its devices (--rl-phase both): move "
              "parameters, gradients and optimizer state to host memory after each iteration's checkpoint and back "
              "before the next step; false keeps them on the device")
    gpu_memory_gib: float = option(
        0.0, "memory of one GPU in GiB for the memory plan (docs/design.md §10.5), which --dry-run prints and which "
             "refuses at start a run whose trainer and vLLM server do not fit together; 0 = ask GPU 0 of the node "
             "(set it to plan on a machine without the GPU, e.g. 80)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "compute dtype; auto = float32 on CPU, bfloat16 on CUDA. Master weights and "
                "optimizer state stay float32")
    seed: int = option(0, "seed for data order and torch; combined with the iteration number")
    rft_min_reward: float = option(1.0, "rft: a sample is kept when its reward is at least this")
    collective_timeout: float = option(
        600.0, "seconds a trainer rank waits in one collective (a dead peer is reported after this at most)")
    reshard_after_forward: bool = option(
        True, "fsdp: free each decoder block's gathered parameters after its forward and gather them again for "
              "backward; false keeps them gathered until backward (one all-gather less per block, more memory)")
    dp_replicate: int = option(
        1, "fsdp: HSDP replicate degree. The trainer processes form a dp_replicate x dp_shard mesh: parameters are "
           "sharded over dp_shard = processes / dp_replicate ranks and replicated dp_replicate times; must divide "
           "the number of processes (1 = plain FSDP)")
    fsdp_cpu_offload: bool = option(
        False, "fsdp: keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy); "
               "the optimizer step runs on the CPU. Excludes optim_cpu_offload")
    optim_cpu_offload: bool = option(
        False, "keep only the optimizer state in CPU memory between steps (moved to the device for each step). "
               "Excludes fsdp_cpu_offload")
    ac: ActivationCheckpointConfig = section(ActivationCheckpointConfig, "activation checkpointing")
    ac_offloading: ActivationOffloadingConfig = section(ActivationOffloadingConfig, "activation offloading")
    fused_lm_head_token_chunk_size: int | Literal["auto", "disabled"] = option(
        "auto", "compute the logprobs and entropy of the sampled tokens this many tokens at a time, never holding the "
                "[tokens, vocab] logits (recomputed per chunk in backward); auto = about 16M logits per chunk "
                "(512 tokens for a 32k vocabulary); disabled = all logits at once")
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters")
    compile: CompileConfig | None = option(
        None, "torch.compile each decoder block: {} (or {fullgraph: true}) to enable, null = eager. "
              "On the command line: train.compile={}")
    ep: int = option(
        1, "expert-parallel degree for mixture-of-experts models (Qwen3-MoE): each MoE layer's experts are split "
           "over groups of ep ranks and tokens travel to their experts' rank by all-to-all; must divide the number "
           "of trainer processes and the experts per layer. Needs backend=fsdp and dp_replicate=1 (1 = off)")
    cp: int = option(
        1, "context-parallel degree: each micro-batch's sequences are split along the tokens over cp "
           "ranks of one node, which attend as train.cp_kind says; must divide train.nproc_per_node "
           "(and, for ulysses, the model's attention and kv heads). Needs backend=fsdp, attn=sdpa (1 = off)")
    cp_kind: Literal["ulysses", "ring"] = option(
        "ulysses", "how a context-parallel group attends over its split sequence: ulysses (all-to-all trades "
                   "positions for heads; heads and kv heads must divide by cp) or ring (keys and values travel "
                   "around the group, plain torch without a flash kernel; any head count)")
    attn: Literal["sdpa", "flash_attention_2", "eager"] = option(
        "sdpa", "attention implementation of transformers: sdpa (PyTorch), flash_attention_2 (needs the flash-attn "
                "package and CUDA), eager (reference)")

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
        non_negative(self.gpu_memory_gib, "train.gpu_memory_gib")
        if self.fsdp_cpu_offload and self.optim_cpu_offload:
            raise ConfigError("train.fsdp_cpu_offload and train.optim_cpu_offload are mutually exclusive: "
                              "fsdp_cpu_offload already keeps the optimizer state (with parameters and gradients) in "
                              "CPU memory. Set one of them to false")
        if self.dp_replicate < 1:
            raise ConfigError(f"train.dp_replicate must be at least 1 (got {self.dp_replicate}); 1 = plain FSDP")
        if self.backend == "ddp" and (self.dp_replicate != 1 or self.fsdp_cpu_offload):
            raise ConfigError("train.dp_replicate and train.fsdp_cpu_offload are FSDP2 options but train.backend=ddp; "
                              "set train.backend=fsdp or drop them")
        check_ep_levers(self)
        check_cp_levers(self)
        chunk = self.fused_lm_head_token_chunk_size
        if isinstance(chunk, int) and chunk < 1:
            raise ConfigError(f"train.fused_lm_head_token_chunk_size must be auto, disabled or a positive number of "
                              f"tokens (got {chunk})")
