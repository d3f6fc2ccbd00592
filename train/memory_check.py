"""The start-up refusal of a job whose vLLM engine and trainer share the GPUs and do not fit
(docs/design.md §10.5): before the run folder is written, exit 2 with the numbers of each phase
that overflows and each single setting that would make it fit."""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any

from coordination.config import ConfigError
from train.memory_plan import ENGINE_ASLEEP_GIB, VLLM_RUNTIME_GIB, MemoryPlan, engine_on_gpu, make_plan
from train.model_shape import GIB
from train.trainer_memory import TRAINER_RESIDUE_GIB, trainer_memory


def _utilization(plan: MemoryPlan, beside: float) -> str | None:
    """The largest gpu_memory_utilization that leaves `beside` bytes free and still a KV cache."""
    gpu, e = plan.gpu_bytes, plan.engine
    util = math.floor((gpu - beside) / gpu * 100) / 100
    kv = util * gpu - e.weights - VLLM_RUNTIME_GIB * GIB
    if util <= 0 or kv <= 0:
        return None
    return (f"inference.vllm.gpu_memory_utilization={util:.2f} (engine {util * gpu / GIB:.1f} GiB, "
            f"KV cache {kv / GIB:.1f} GiB)")


def _training_fixes(cfg: Any, plan: MemoryPlan) -> list[str]:
    """The single settings that would make the training phase fit, each with its total."""
    gpu, out = plan.gpu_bytes, []
    e, t = plan.engine, plan.trainer
    if cfg.inference.between_iterations == "reload" and t.peak + ENGINE_ASLEEP_GIB * GIB <= gpu:
        out.append(f"inference.between_iterations=sleep (trainer {t.peak / GIB:.1f} + asleep engine "
                   f"{ENGINE_ASLEEP_GIB:.1f} GiB)")
    if t.peak <= gpu:
        out.append(f"inference.between_iterations=restart (trainer alone, {t.peak / GIB:.1f} GiB; the server "
                   f"starts again each iteration)")
    lower = _utilization(plan, t.peak) if cfg.inference.between_iterations == "reload" else None
    if lower:
        out.append(lower)
    levers = [("train.optim_cpu_offload=true", {"optim_cpu_offload": True, "fsdp_cpu_offload": False}),
              ("train.fsdp_cpu_offload=true", {"fsdp_cpu_offload": True, "optim_cpu_offload": False})]
    if cfg.train.ac.freq != 1 or cfg.train.ac.mode != "full":
        levers.append(("train.ac.freq=1 train.ac.mode=full", {"ac": replace(cfg.train.ac, freq=1, mode="full")}))
    if not cfg.train.ac_offloading.enabled:
        levers.append(("train.ac_offloading.enabled=true",
                       {"ac_offloading": replace(cfg.train.ac_offloading, enabled=True)}))
    half = cfg.train.micro_batch_tokens // 2
    if half >= 16:  # train.micro_batch_tokens' own lower bound
        levers.append((f"train.micro_batch_tokens={half} (if the longest prompt + completion fits)",
                       {"micro_batch_tokens": half}))
    for text, change in levers:
        if (cfg.train.backend != "fsdp" or cfg.train.ep > 1) and "fsdp_cpu_offload" in text:
            continue  # DDP has no FSDP offload; expert parallelism does not combine with it
        peak = trainer_memory(plan.shape, replace(cfg.train, **change), plan.world_size).peak
        if peak + e.during_training <= gpu:
            out.append(f"{text} (trainer {peak / GIB:.1f} + engine {e.during_training / GIB:.1f} GiB)")
    return out


def _rollout_fixes(cfg: Any, plan: MemoryPlan) -> list[str]:
    """The single settings that would make the rollouts fit beside what the trainer keeps."""
    gpu, e, out = plan.gpu_bytes, plan.engine, []
    residue = TRAINER_RESIDUE_GIB * GIB
    if not cfg.train.offload_between_iterations and e.budget + residue <= gpu:
        out.append(f"train.offload_between_iterations=true (engine {e.budget / GIB:.1f} + trainer "
                   f"{TRAINER_RESIDUE_GIB:.1f} GiB, its state in host memory between iterations)")
    if cfg.train.resident:
        out.append("train.resident=false (the trainer ends after each iteration and loads its state again)")
    lower = _utilization(plan, plan.residue[1])
    return out + [lower] if lower else out


def _ways(fixes: list[str]) -> str:
    if fixes:
        return "; settings that fit: " + "; ".join(fixes)
    return "; no single setting fits: combine them or use more GPUs (scripts/run.sh --dry-run prints the plan)"


def check_memory(cfg: Any, *, serves: bool, trains: bool, num_nodes: int,
                 debug_mode: bool = False) -> MemoryPlan | None:
    """Refuse (ConfigError) a job that serves an engine on the GPUs it trains on when the two do not
    fit together, while training or while rolling out; return the plan (None when there is none to
    make). A trainer that does not fit alone is left to its own out-of-memory error."""
    if not (serves and trains and engine_on_gpu(cfg, debug_mode)):
        return None
    try:
        plan = make_plan(cfg, serves=serves, trains=trains, num_nodes=num_nodes, debug_mode=debug_mode)
    except ConfigError as exc:  # a model the estimate cannot read is not a reason to refuse the run
        print(f"memory plan skipped: {exc}", file=sys.stderr)
        return None
    if plan is None:
        print("memory plan skipped: no GPU visible on this node and train.gpu_memory_gib=0", file=sys.stderr)
        return None
    e, t, gpu = plan.engine, plan.trainer, plan.gpu_bytes
    per_gpu = f"of the {gpu / GIB:.1f} GiB per GPU ({plan.gpu_source})"
    util = f"gpu_memory_utilization {cfg.inference.vllm.gpu_memory_utilization} x {gpu / GIB:.1f} GiB"
    if e.kv_cache <= 0:
        raise ConfigError(f"memory plan: vLLM's weights ({e.weights / GIB:.1f} GiB per GPU) and runtime "
                          f"({VLLM_RUNTIME_GIB:.1f} GiB) leave no KV cache in inference.vllm.{util}; raise it or "
                          f"raise inference.vllm.tensor_parallel_size")
    problems = []
    if e.during_training and plan.training_total > gpu:
        kept = f" = {util}" if cfg.inference.between_iterations == "reload" else " asleep"
        problems.append(
            f"the trainer ({t.peak / GIB:.1f} GiB peak per GPU) and the vLLM server that "
            f"inference.between_iterations={cfg.inference.between_iterations} keeps during training "
            f"({e.during_training / GIB:.1f} GiB{kept}) need {plan.training_total / GIB:.1f} GiB {per_gpu}"
            f"{_ways(_training_fixes(cfg, plan))}")
    judge = plan.judge
    if plan.rollout_total > gpu:
        why, residue = plan.residue
        beside = (f", the judge's vLLM server ({judge / GIB:.1f} GiB = tasks.judge.gpu_memory_utilization "
                  f"{cfg.tasks.judge.gpu_memory_utilization} x {gpu / GIB:.1f} GiB)" if judge else "")
        room = (gpu - plan.rollout_total + judge) / gpu  # what the judge may take when the rest fits without it
        fixes = _rollout_fixes(cfg, plan) if room <= 0 else [
            f"tasks.judge.gpu_memory_utilization={int(room * 100) / 100:.2f} or less"] if room >= 0.01 else []
        if judge:
            fixes.append("the judge behind tasks.judge.url (not on these GPUs)")
        problems.append(
            f"while rolling out, the vLLM server ({e.budget / GIB:.1f} GiB = {util}, taken when it starts or "
            f"wakes){beside} and the trainer ({residue / GIB:.1f} GiB: {why}) need "
            f"{plan.rollout_total / GIB:.1f} GiB {per_gpu}{_ways(fixes)}")
    if problems:
        raise ConfigError("memory plan: " + "; and ".join(problems))
    return plan
