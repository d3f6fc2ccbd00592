"""How much GPU memory the trainer and the vLLM engine need per device, before anything loads.

From the model's `config.json` (no weights), the memory of one GPU (`train.gpu_memory_gib`, or
GPU 0 of this node), the parallel layout and the levers, the plan estimates per device
(docs/design.md §10.5 has two worked examples with the arithmetic) the trainer
(train/trainer_memory.py) and the engine, in each of the two phases where they may share a GPU:

- training: the trainer's peak beside what the engine keeps, which between_iterations decides:
  reload keeps it all, sleep keeps ENGINE_ASLEEP_GIB (weights and KV cache freed; level 1 copies
  the weights to host memory first), restart stops the server;
- rolling out: vLLM's gpu_memory_utilization x the GPU (its weights in the serving dtype, P x
  bytes / tensor_parallel_size, VLLM_RUNTIME_GIB of activations, CUDA graphs and context, and the
  KV cache, 2 x layers x kv x bytes per token, in the rest) beside what a resident trainer keeps
  between iterations (trainer_memory.rollout_residue). vLLM takes its budget when it starts or
  wakes and fails when that much is not free, so a trainer that kept its state there breaks the
  wake, not the rollouts.

The engine and the trainer share the GPUs when the job both serves and trains and vLLM runs on
the GPU. The fixed overheads are estimates, not measurements (there was no GPU where this was
written); the gpu test tier compares the trainer's peak with a measured one.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.inference import resolve_dtype
from train.checkpoint_size import CheckpointSize, checkpoint_size, format_checkpoint_size
from train.model_shape import DTYPE_BYTES, GIB, ModelShape, table_row
from train.trainer_memory import TrainerMemory, rollout_residue, trainer_memory

VLLM_RUNTIME_GIB = 2.0
ENGINE_ASLEEP_GIB = 2.0


@dataclass(frozen=True)
class EngineMemory:
    """Bytes per GPU of the vLLM server (module docstring)."""

    weights: float
    budget: float            # gpu_memory_utilization x the GPU
    kv_cache: float
    kv_tokens: int
    during_training: float   # what stays on the GPU while the trainer runs
    mode: str


def engine_memory(shape: ModelShape, inference: Any, gpu_bytes: float) -> EngineMemory:
    v = inference.vllm
    d = DTYPE_BYTES[resolve_dtype(inference, on_gpu=True)]
    weights = shape.params * d / v.tensor_parallel_size
    budget = v.gpu_memory_utilization * gpu_bytes
    kv = budget - weights - VLLM_RUNTIME_GIB * GIB
    per_token = shape.kv_cache_bytes_per_token(d) / v.tensor_parallel_size
    mode = inference.between_iterations
    during = {"reload": budget, "sleep": ENGINE_ASLEEP_GIB * GIB, "restart": 0.0}[mode]
    if mode == "sleep":
        mode = f"sleep (level {v.sleep_level})"
    return EngineMemory(weights, budget, kv, max(0, int(kv // per_token)), during, mode)


@dataclass(frozen=True)
class MemoryPlan:
    """One node's plan: its trainer and engine per GPU in the two phases, and a checkpoint's size."""

    gpu_bytes: float
    gpu_source: str
    shape: ModelShape
    world_size: int
    trainer: TrainerMemory | None
    engine: EngineMemory | None
    shared: bool                    # engine and trainer on the same GPUs (the job serves and trains)
    residue: tuple[str, float]      # (why, bytes) the trainer keeps beside the rolling-out engine
    disk: CheckpointSize | None     # one checkpoint on disk, when the job trains
    judge: float = 0.0              # an LLM judge's vLLM server on these GPUs, for the rollout phase only

    @property
    def training_total(self) -> float:
        return (self.trainer.peak if self.trainer else 0.0) + \
            (self.engine.during_training if self.engine and self.shared else 0.0)

    @property
    def rollout_total(self) -> float:
        return (self.engine.budget if self.engine else 0.0) + (self.residue[1] if self.shared else 0.0) + self.judge

    @property
    def fits(self) -> bool:
        return max(self.training_total, self.rollout_total) <= self.gpu_bytes and \
            (self.engine is None or self.engine.kv_cache > 0)


def judge_share(cfg: Any) -> float:
    """The fraction of each GPU a judge's vLLM server takes for the rollout phase (0: no judge on
    the GPUs). It starts with the phase and stops at its end, so it adds to the rollout phase only."""
    j = cfg.tasks.judge
    return j.gpu_memory_utilization if (j.enabled and not j.url and j.engine == "vllm"
                                        and not cfg.inference.vllm.cpu) else 0.0


def engine_on_gpu(cfg: Any, debug_mode: bool = False) -> bool:
    inf = cfg.inference
    return inf.engine == "vllm" and not inf.vllm.cpu and not (debug_mode and inf.vllm.debug_url)


def gpu_visible() -> bool:
    """Whether this node has an NVIDIA or AMD GPU that its processes may use (device files, and no
    empty CUDA_VISIBLE_DEVICES), asked without torch: a CUDA context in the driver would hold memory
    on GPU 0 for the whole run."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    return Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists()


def detect_gpu_memory_gib() -> float | None:
    """Memory of this node's GPU 0, asked in a child process (see gpu_visible). None when the node
    has no NVIDIA or AMD GPU."""
    if not gpu_visible():
        return None
    code = ("import torch\nprint(torch.cuda.get_device_properties(0).total_memory "
            "if torch.cuda.is_available() else 0)")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        total = int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return total / GIB if total else None


def make_plan(cfg: Any, *, serves: bool, trains: bool, num_nodes: int, debug_mode: bool = False,
              gpu_gib: float | None = None) -> MemoryPlan | None:
    """The plan of a job that `serves` an engine and/or `trains` (rl/jobs.py JobKind) on this node,
    or None when there is nothing to plan on a GPU (no vLLM on GPU and no train.gpu_memory_gib) or
    the GPU's memory is unknown."""
    train = cfg.train
    if not (engine_on_gpu(cfg, debug_mode) or train.gpu_memory_gib):
        return None
    engine_gpu = engine_on_gpu(cfg, debug_mode) and serves
    if train.gpu_memory_gib:
        gib, source = train.gpu_memory_gib, "train.gpu_memory_gib"
    else:
        gib, source = (gpu_gib if gpu_gib is not None else detect_gpu_memory_gib()), "GPU 0 of this node"
        if not gib:
            return None
    shape = ModelShape.from_model_dir(Path(cfg.model.path))
    world = num_nodes * train.nproc_per_node
    trainer = trainer_memory(shape, train, world) if trains else None
    residue = rollout_residue(train, trainer) if trainer else ("no trainer", 0.0)
    return MemoryPlan(gib * GIB, source, shape, world, trainer,
                      engine_memory(shape, cfg.inference, gib * GIB) if engine_gpu else None,
                      engine_gpu and trains, residue, checkpoint_size(shape, train, on_gpu=True) if trains else None,
                      judge_share(cfg) * gib * GIB if engine_gpu else 0.0)


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a plain-text table of at most 100 columns."""
    s = plan.shape
    lines = [f"model: {s.params / 1e9:.2f}B parameters ({s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} "
             f"heads, MLP {s.intermediate}, vocab {s.vocab}{', tied' if s.tied else ''})",
             f"GPU memory: {plan.gpu_bytes / GIB:.1f} GiB ({plan.gpu_source}); {plan.world_size} trainer processes",
             "", f"  {'per GPU':<80} {'GiB':>7}"]
    t = plan.trainer
    if t:
        lines.append("  trainer (one process), held through forward and backward")
        lines += [table_row(name, b) for name, b in t.rows]
        lines.append("    and the larger of backward's two moments:")
        for moment, rows in (("the LM head's backward", t.head), ("a block recomputed", t.block)):
            lines.append(table_row(moment, sum(b for _, b in rows)))
            lines += [table_row(name, b, 6) for name, b in rows]
        lines.append(table_row("peak of forward/backward", t.forward_backward))
        lines.append(table_row("peak of the optimizer step", t.step_peak))
        lines += [f"    ({n})" for n in t.notes]
    e = plan.engine
    if e:
        lines.append("  vLLM engine")
        lines.append(table_row("weights (serving dtype, / tensor_parallel_size)", e.weights))
        lines.append(table_row(f"KV cache: ~{e.kv_tokens:,} tokens", e.kv_cache))
        lines.append(table_row("while rolling out: gpu_memory_utilization x GPU", e.budget))
        lines.append(table_row(f"while training: between_iterations={e.mode}",
                               e.during_training if plan.shared else 0.0))
        if e.kv_cache <= 0:
            lines.append("    DOES NOT FIT: no room for a KV cache; raise gpu_memory_utilization")
    if plan.judge:
        lines.append(table_row("judge's vLLM server, rollout only: judge.gpu_memory_utilization x GPU", plan.judge))
    of = f"of {plan.gpu_bytes / GIB:.1f} GiB"
    if t:
        who = "trainer + engine" if plan.shared else "trainer"
        lines.append(table_row(f"while training ({who}) {of}: {_verdict(plan.training_total, plan)}",
                               plan.training_total, 2))
    if plan.shared or plan.judge:
        who = " + ".join(["engine", *(["judge"] if plan.judge else []), *(["trainer"] if plan.shared else [])])
        lines.append(table_row(f"while rolling out ({who}) {of}: {_verdict(plan.rollout_total, plan)}",
                               plan.rollout_total, 2))
    if plan.shared:
        lines.append(table_row(f"trainer: {plan.residue[0]}", plan.residue[1]))
    if plan.disk:
        lines += ["", *format_checkpoint_size(plan.disk)]
    return "\n".join(lines)


def _verdict(total: float, plan: MemoryPlan) -> str:
    return "fits" if total <= plan.gpu_bytes else "DOES NOT FIT"
