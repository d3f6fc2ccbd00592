"""How much GPU memory the trainer and the vLLM engine need per device, before anything loads.

From the model's `config.json` (no weights), the memory of one GPU (`train.gpu_memory_gib`, or
GPU 0 of this node), the parallel layout and the levers, the plan estimates per device
(docs/design.md §10.5 has a worked example with the arithmetic):

Trainer, per process (FSDP2 shards over dp_shard = processes / dp_replicate ranks; DDP holds all):
- parameters: float32 master weights, 4 B x P / dp_shard (on the host with fsdp_cpu_offload);
- gathered parameters: FSDP2 all-gathers in the compute dtype (d bytes): the root module
  (embedding, LM head, final norm) from forward to backward, plus two decoder blocks at a time (the
  one running and the one prefetched), or every block with reshard_after_forward=false. DDP under
  autocast keeps d-byte copies of all weights from forward to backward;
- gradients: float32 like the master weights, 4 B x trained / dp_shard (host with
  fsdp_cpu_offload), plus one block's unsharded float32 gradient on its way to the reduce-scatter
  (DDP: full gradients plus its float32 buckets);
- AdamW state: two float32 moments, 8 B x trained / dp_shard. fsdp_cpu_offload keeps it on the
  host; optim_cpu_offload keeps it there between steps but moves it to the device for the step,
  so it counts in the optimizer-step peak, not in the forward/backward one. The step itself
  allocates one float32 temporary per trained tensor (foreach AdamW's square root of the second
  moment): 4 B x trained / dp_shard more in the optimizer-step peak;
- activations of one micro-batch of T = micro_batch_tokens tokens. A Llama-style decoder block
  (hidden h, query width hq = heads x head_dim, key/value width kv = kv_heads x head_dim, MLP
  width i) keeps for backward, per token, in bytes:
      A = 2 (4 + d) h                  two RMSNorms: float32 copy of the input + normalised output
        + d (2 h + 2 hq + 2 kv + 4 i)  norm outputs, rotated q and k, v, attention output,
                                       gate, silu(gate), up, silu(gate) * up
        + 4 heads                      log-sum-exp of the fused attention kernel (SDPA, flash)
  i.e. 20 h + 4 kv + 8 i (+ 4 heads) for bf16: 45.5 h for Llama-2-7B, where Korthikanti et al.'s
  ~34 h for GPT counts a 4h MLP and dropout masks and no fused attention. attn=eager adds the
  [heads, s, s] scores and probabilities, 2 d heads s per token with s = T at most. A block under
  full activation checkpointing keeps only its input (d h); selective also keeps its targets'
  outputs (attention: d hq; matmul: every projection's output). Any checkpointing adds one
  block's A as the working set of the recomputation in backward. Outside the blocks: the final
  norm and its output, (4 + 2 d) h. Activation offloading leaves on the device the working set
  plus max_inflight_activations copies in flight of the largest saved tensor (d i per token);
- LM head: chunked (train.fused_lm_head_token_chunk_size), three float32 chunks of
  [chunk, vocab] (logits, softmax, gradient); disabled, [T, vocab] logits in d bytes, their
  float32 copy and log-softmax, and a float32 gradient: (d + 12) x vocab per token;
- the reference policy when kl_coef > 0: another float32 parameter shard;
- a fixed TRAINER_OVERHEAD_GIB: CUDA context, NCCL communicators, cuBLAS workspaces and the
  caching allocator's fragmentation.
Peak = max(forward/backward, optimizer step) of those that are resident at each moment.

Engine, per GPU: vLLM keeps at most gpu_memory_utilization x the GPU's memory: its weights in the
serving dtype (P x bytes / tensor_parallel_size), VLLM_RUNTIME_GIB of activations, CUDA graphs
and context, and the KV cache in the rest (2 x layers x kv x bytes per token). While the trainer
runs, between_iterations decides what stays: reload keeps it all, sleep keeps
ENGINE_ASLEEP_GIB (weights and KV cache freed; level 1 copies the weights to host memory first),
restart stops the server.

A run whose engine and trainer share GPUs during training (job both, vLLM on GPU, reload or
sleep) and whose sum exceeds the GPU is refused at start with the numbers and the settings that
would fit. All three fixed overheads are estimates, not measurements (there is no GPU where this
was written); the gpu test tier compares the plan with measured peaks.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from coordination.config import ConfigError
from rollout.inference import resolve_dtype

GIB = 2**30
TRAINER_OVERHEAD_GIB = 3.0
VLLM_RUNTIME_GIB = 2.0
ENGINE_ASLEEP_GIB = 2.0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that memory depends on (read from config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "ModelShape":
        c = c.get("text_config") or c  # multimodal configs nest the language model's
        try:
            h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            return cls(hidden=h, layers=int(c["num_hidden_layers"]), heads=heads,
                       kv_heads=int(c.get("num_key_value_heads") or heads),
                       head_dim=int(c.get("head_dim") or h // heads), intermediate=int(c["intermediate_size"]),
                       vocab=int(c["vocab_size"]), tied=bool(c.get("tie_word_embeddings", False)),
                       attention_bias=bool(c.get("attention_bias", False)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the model's config.json lacks a decoder size the memory plan needs ({exc}); it reads "
                              f"hidden_size, num_hidden_layers, num_attention_heads, intermediate_size and "
                              f"vocab_size") from None

    @classmethod
    def from_model_dir(cls, path: Path) -> "ModelShape":
        file = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {file} for the memory plan: {exc}") from None

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one block, by its Hugging Face name."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def block_params(self) -> int:
        bias = self.q_width + 2 * self.kv_width if self.attention_bias else 0
        return sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden + bias

    @property
    def root_params(self) -> int:
        """Embedding, LM head (unless tied to the embedding) and final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.root_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        per_block = sum(rank * (a + b) for name, (a, b) in shapes.items() if name in targets)
        head = rank * (self.hidden + self.vocab) if "lm_head" in targets else 0
        return self.layers * per_block + head

    def block_activation_bytes(self, d: int) -> int:
        """A: bytes one block keeps for backward per token without checkpointing (module docstring)."""
        h = self.hidden
        return 2 * (4 + d) * h + d * (2 * h + 2 * self.q_width + 2 * self.kv_width + 4 * self.intermediate) \
            + 4 * self.heads

    def kv_cache_bytes_per_token(self, d: int) -> int:
        return 2 * self.layers * self.kv_width * d


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes per trainer process on its GPU, by component; `peak` is the largest moment."""

    rows: list[tuple[str, float]]      # (what, bytes) resident during forward/backward
    step_peak: float                    # resident during the optimizer step
    notes: list[str]

    @property
    def forward_backward(self) -> float:
        return sum(b for _, b in self.rows)

    @property
    def peak(self) -> float:
        return max(self.forward_backward, self.step_peak)


def _activations(shape: ModelShape, train: Any, d: int, tokens: int) -> tuple[float, str]:
    a = shape.block_activation_bytes(d)
    if train.attn == "eager":
        a += 2 * d * shape.heads * tokens
    freq, n = train.ac.freq, shape.layers
    checkpointed = len(range(0, n, freq)) if freq else 0
    if train.ac.mode == "selective":
        targets = set(train.ac.targets)
        keep = d * shape.hidden
        if "attention" in targets:
            keep += d * shape.q_width
        if "matmul" in targets:
            keep += d * sum(b for _, b in shape.linear_shapes().values())
        if any(t.startswith("aten.") for t in targets):
            keep = a  # operators named one by one: assume they keep what the block keeps
    else:
        keep = d * shape.hidden
    outside = (4 + 2 * d) * shape.hidden
    working = a if checkpointed else 0
    kept = checkpointed * keep + (n - checkpointed) * a
    what = f"{checkpointed}/{n} blocks checkpointed ({train.ac.mode})" if checkpointed else "no checkpointing"
    if train.ac_offloading.enabled:
        inflight = train.ac_offloading.max_inflight_activations * d * max(shape.hidden, shape.intermediate)
        return (working + inflight + outside) * tokens, what + ", offloaded to host"
    return (kept + working + outside) * tokens, what


def trainer_memory(shape: ModelShape, train: Any, world_size: int, *, on_gpu: bool = True) -> TrainerMemory:
    """The estimate of the module docstring for one trainer process of `world_size`."""
    from train.chunked_head import resolve_chunk_size

    d = DTYPE_BYTES["bfloat16" if train.dtype == "auto" and on_gpu else
                    "float32" if train.dtype == "auto" else train.dtype]
    fsdp = train.backend == "fsdp"
    shard = world_size // train.dp_replicate if fsdp else 1
    p = shape.params
    trained = shape.lora_params(train.lora.rank, train.lora.target_modules) if train.lora.rank else p
    trained_block = trained / shape.layers if train.lora.rank else shape.block_params
    host = fsdp and train.fsdp_cpu_offload
    rows: list[tuple[str, float]] = []
    params = 0.0 if host else 4 * p / shard
    rows.append((f"parameters: fp32 master, 1/{shard} shard" + (" (on host)" if host else ""), params))
    if fsdp:
        blocks = 2 if train.reshard_after_forward else shape.layers
        rows.append((f"gathered parameters: {d}-byte root + {blocks} blocks",
                     d * (shape.root_params + blocks * shape.block_params)))
        grads = (0.0 if host else 4 * trained / shard) + 4 * trained_block
        rows.append((f"gradients: fp32, 1/{shard} shard + one block unsharded", grads))
    else:
        rows.append((f"autocast {d}-byte weight copies (DDP)", d * p if d < 4 else 0.0))
        grads = 8 * trained
        rows.append(("gradients: fp32 + DDP buckets", grads))
    optim = 0.0 if host else 8 * trained / shard
    where = " (on host)" if host else " (on host between steps)" if train.optim_cpu_offload else ""
    rows.append((f"AdamW state: 2 x fp32, 1/{shard} shard{where}", 0.0 if train.optim_cpu_offload else optim))
    tokens = train.micro_batch_tokens
    acts, what = _activations(shape, train, d, tokens)
    rows.append((f"activations: {tokens} tokens, {what}", acts))
    chunk = resolve_chunk_size(train.fused_lm_head_token_chunk_size, shape.vocab)
    if chunk is None:
        rows.append(("LM head: all logits", (d + 12) * shape.vocab * tokens))
    else:
        rows.append((f"LM head: chunks of {chunk} tokens", 3 * 4 * min(chunk, tokens) * shape.vocab + 8 * tokens))
    reference = 0.0
    if train.kl_coef > 0:
        reference = 0.0 if host else 4 * p / shard
        rows.append((f"reference policy: fp32, 1/{shard} shard", reference))
    overhead = TRAINER_OVERHEAD_GIB * GIB
    rows.append(("CUDA context, NCCL, allocator (fixed)", overhead))
    # The step runs after the last backward: activations and gathered copies are freed by then,
    # and optim_cpu_offload has brought the optimizer state back to the device. torch's foreach
    # AdamW allocates one fp32 temporary per trained tensor (the square root of the second moment)
    # while it updates: one more copy of the trained shard, where the state lives.
    temporaries = 0.0 if host else 4 * trained / shard
    step = params + grads + optim + temporaries + reference + overhead
    notes = ["optim_cpu_offload: the optimizer state comes back to the device for each step"] \
        if train.optim_cpu_offload else []
    other = replace(train.ac, freq=0) if train.ac.freq else replace(train.ac, freq=1, mode="full")
    other_acts, other_what = _activations(shape, replace(train, ac=other), d, tokens)
    notes.append(f"activations with {other_what}: {other_acts / GIB:.2f} GiB")
    return TrainerMemory(rows, step, notes)


@dataclass(frozen=True)
class EngineMemory:
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
    gpu_bytes: float
    gpu_source: str
    shape: ModelShape
    world_size: int
    trainer: TrainerMemory | None
    engine: EngineMemory | None
    shared: bool                    # engine and trainer on the same GPUs while training runs

    @property
    def training_total(self) -> float:
        return (self.trainer.peak if self.trainer else 0.0) + \
            (self.engine.during_training if self.engine and self.shared else 0.0)

    @property
    def fits(self) -> bool:
        return self.training_total <= self.gpu_bytes and (self.engine is None or self.engine.kv_cache > 0)


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


def make_plan(cfg: Any, job: str, num_nodes: int, *, debug_mode: bool = False,
              gpu_gib: float | None = None) -> MemoryPlan | None:
    """The plan of this job on this node, or None when there is nothing to plan on a GPU (no vLLM
    on GPU and no train.gpu_memory_gib) or the GPU's memory is unknown."""
    train = cfg.train
    if not (engine_on_gpu(cfg, debug_mode) or train.gpu_memory_gib):
        return None
    engine_gpu = engine_on_gpu(cfg, debug_mode) and job in ("both", "rollout", "eval")
    trains = job in ("both", "update", "bench")
    if train.gpu_memory_gib:
        gib, source = train.gpu_memory_gib, "train.gpu_memory_gib"
    else:
        gib, source = (gpu_gib if gpu_gib is not None else detect_gpu_memory_gib()), "GPU 0 of this node"
        if not gib:
            return None
    shape = ModelShape.from_model_dir(Path(cfg.model.path))
    world = num_nodes * train.nproc_per_node
    shared = (engine_gpu and trains and cfg.inference.between_iterations in ("reload", "sleep"))
    return MemoryPlan(gib * GIB, source, shape, world,
                      trainer_memory(shape, train, world) if trains else None,
                      engine_memory(shape, cfg.inference, gib * GIB) if engine_gpu else None, shared)


def _gib(b: float) -> str:
    return f"{b / GIB:7.2f}"


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a plain-text table of at most 100 columns."""
    s = plan.shape
    lines = [f"model: {s.params / 1e9:.2f}B parameters ({s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_heads} "
             f"heads, MLP {s.intermediate}, vocab {s.vocab}{', tied' if s.tied else ''})",
             f"GPU memory: {plan.gpu_bytes / GIB:.1f} GiB ({plan.gpu_source}); {plan.world_size} trainer processes",
             "", f"  {'per GPU':<80} {'GiB':>7}"]
    if plan.trainer:
        lines.append("  trainer (one process)")
        lines += [f"    {name:<78} {_gib(b)}" for name, b in plan.trainer.rows]
        lines.append(f"    {'peak of forward/backward':<78} {_gib(plan.trainer.forward_backward)}")
        lines.append(f"    {'peak of the optimizer step':<78} {_gib(plan.trainer.step_peak)}")
        lines += [f"    ({n})" for n in plan.trainer.notes]
    e = plan.engine
    if e:
        lines.append("  vLLM engine")
        lines.append(f"    {'weights (serving dtype, / tensor_parallel_size)':<78} {_gib(e.weights)}")
        lines.append(f"    {f'KV cache: ~{e.kv_tokens:,} tokens':<78} {_gib(e.kv_cache)}")
        lines.append(f"    {'while rolling out: gpu_memory_utilization x GPU':<78} {_gib(e.budget)}")
        lines.append(f"    {f'while training: between_iterations={e.mode}':<78} "
                     f"{_gib(e.during_training if plan.shared else 0.0)}")
        if e.kv_cache <= 0:
            lines.append("    DOES NOT FIT: no room for a KV cache; raise gpu_memory_utilization")
    if plan.trainer:
        verdict = "fits" if plan.training_total <= plan.gpu_bytes else "DOES NOT FIT"
        who = "trainer + engine" if plan.shared else "trainer"
        lines.append(f"  {f'while training ({who}) of {plan.gpu_bytes / GIB:.1f} GiB: {verdict}':<80} "
                     f"{_gib(plan.training_total)}")
    return "\n".join(lines)


def _fixes(cfg: Any, plan: MemoryPlan, job: str, num_nodes: int) -> list[str]:
    """The single settings that would make the training phase fit, each with its total."""
    gpu, out = plan.gpu_bytes, []
    e, t = plan.engine, plan.trainer
    if cfg.inference.between_iterations == "reload" and t.peak + ENGINE_ASLEEP_GIB * GIB <= gpu:
        out.append(f"inference.between_iterations=sleep (trainer {t.peak / GIB:.1f} + asleep engine "
                   f"{ENGINE_ASLEEP_GIB:.1f} GiB)")
    if t.peak <= gpu:
        out.append(f"inference.between_iterations=restart (trainer alone, {t.peak / GIB:.1f} GiB; the server "
                   f"starts again each iteration)")
    if cfg.inference.between_iterations == "reload":
        util = math.floor((gpu - t.peak) / gpu * 100) / 100
        kv = util * gpu - e.weights - VLLM_RUNTIME_GIB * GIB
        if util > 0 and kv > 0:
            out.append(f"inference.vllm.gpu_memory_utilization={util:.2f} (engine {util * gpu / GIB:.1f} GiB, "
                       f"KV cache {kv / GIB:.1f} GiB)")
    levers = [("train.optim_cpu_offload=true", {"optim_cpu_offload": True, "fsdp_cpu_offload": False}),
              ("train.fsdp_cpu_offload=true", {"fsdp_cpu_offload": True, "optim_cpu_offload": False})]
    if cfg.train.ac.freq != 1 or cfg.train.ac.mode != "full":
        levers.append(("train.ac.freq=1 train.ac.mode=full", {"ac": replace(cfg.train.ac, freq=1, mode="full")}))
    for text, change in levers:
        if cfg.train.backend != "fsdp" and "fsdp_cpu_offload" in text:
            continue
        peak = trainer_memory(plan.shape, replace(cfg.train, **change), plan.world_size).peak
        if peak + e.during_training <= gpu:
            out.append(f"{text} (trainer {peak / GIB:.1f} + engine {e.during_training / GIB:.1f} GiB)")
    return out


def check_memory(cfg: Any, job: str, num_nodes: int, *, debug_mode: bool = False) -> MemoryPlan | None:
    """Refuse (ConfigError) a job whose trainer and engine share the GPUs while training and do not
    fit; return the plan (None when there is none to make)."""
    if not (job == "both" and engine_on_gpu(cfg, debug_mode)
            and cfg.inference.between_iterations in ("reload", "sleep")):
        return None  # nothing shares the GPUs while training: the trainer's own OOM is its own error
    try:
        plan = make_plan(cfg, job, num_nodes, debug_mode=debug_mode)
    except ConfigError as exc:  # a model the estimate cannot read is not a reason to refuse the run
        print(f"memory plan skipped: {exc}", file=sys.stderr)
        return None
    if plan is None:
        print("memory plan skipped: no GPU visible on this node and train.gpu_memory_gib=0", file=sys.stderr)
        return None
    if plan.fits:
        return plan
    e, t = plan.engine, plan.trainer
    if e.kv_cache <= 0:
        raise ConfigError(f"memory plan: vLLM's weights ({e.weights / GIB:.1f} GiB per GPU) and runtime "
                          f"({VLLM_RUNTIME_GIB:.1f} GiB) leave no KV cache in inference.vllm.gpu_memory_utilization="
                          f"{cfg.inference.vllm.gpu_memory_utilization} x {plan.gpu_bytes / GIB:.1f} GiB; raise it or "
                          f"raise inference.vllm.tensor_parallel_size")
    fixes = _fixes(cfg, plan, job, num_nodes)
    kept = (f" = gpu_memory_utilization {cfg.inference.vllm.gpu_memory_utilization} x {plan.gpu_bytes / GIB:.1f} GiB"
            if cfg.inference.between_iterations == "reload" else " asleep")
    ways = ("; settings that fit: " + "; ".join(fixes)) if fixes else \
        "; no single setting fits: combine them or use more GPUs (scripts/run.sh --dry-run prints the plan)"
    raise ConfigError(
        f"memory plan: the trainer ({t.peak / GIB:.1f} GiB peak per GPU) and the vLLM server that "
        f"inference.between_iterations={cfg.inference.between_iterations} keeps during training "
        f"({e.during_training / GIB:.1f} GiB{kept}) need {plan.training_total / GIB:.1f} GiB of the "
        f"{plan.gpu_bytes / GIB:.1f} GiB per GPU ({plan.gpu_source}){ways}")
