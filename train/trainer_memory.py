"""How much GPU memory one trainer process needs, from the model's shape and the `train` levers
(docs/design.md §10.5 has worked examples with the arithmetic). FSDP2 shards over
dp_shard = processes / dp_replicate ranks; DDP holds everything on every rank. d is the compute
dtype's bytes (2 for bf16), P the parameters, V x h the LM head.

Held from forward through backward:
- parameters: float32 master weights, 4 B x P / dp_shard (on the host with fsdp_cpu_offload);
- gathered parameters: FSDP2 all-gathers in d bytes the root module (embedding, LM head, final
  norm; FSDP2 keeps the root gathered from forward to backward) and two decoder blocks at a time
  (the one running and the one prefetched), or every block with reshard_after_forward=false. DDP
  under autocast keeps d-byte copies of all weights;
- gradients: float32 shards, 4 B x trained / dp_shard (host with fsdp_cpu_offload); DDP: full
  gradients plus its float32 buckets;
- AdamW state: two float32 moments, 8 B x trained / dp_shard (host with fsdp_cpu_offload; with
  optim_cpu_offload only during the step);
- activations kept for backward: T = micro_batch_tokens tokens (micro_batch_tokens / cp under
  context parallelism, whose backward also holds one layer's all-to-all send and receive copies
  of q, k and v or their gradients, 2 d (hq + 2 kv) T; ring attention instead adds to A about
  4 hq (1 + 2 cp) + 8 heads cp + 2 (cp - 1) d kv per token and holds one query chunk's float32
  scores, probabilities and gradients, 16 heads min(512, T) T) x (per block: A without
  checkpointing, its input d h under full checkpointing, plus its targets' outputs under selective)
  plus the final norm's (4 + 2d) h. A Llama block (hidden h, query width hq, key/value width kv,
  MLP width i) keeps per token A = 2(4 + d)h (two RMSNorms: fp32 input, normalised output)
  + d(2h + 2hq + 2kv + 4i) (norm outputs, rotated q and k, v, attention output, gate, silu(gate),
  up, their product) + 4 heads (the fused attention's log-sum-exp): 45.5 h for Llama-2-7B in bf16;
  attn=eager adds 2 d heads T. Activation offloading leaves max_inflight_activations copies of the
  largest saved tensor (d i per token) instead;
- the KL reference (kl_coef > 0): its float32 shard, 4 B x P / dp_shard (host with
  fsdp_cpu_offload), and under FSDP2 its root in d bytes: the reference runs forward only, so the
  root that FSDP2 gathers for the backward that never comes stays gathered;
- TRAINER_OVERHEAD_GIB: CUDA context, NCCL communicators, cuBLAS workspaces, the caching
  allocator's fragmentation.
Backward begins at the LM head and then recomputes the blocks from the last; its largest moment
is one of two:
- the LM head's backward: the chunks (3 float32 [chunk, V]: logits, softmax, gradient; disabled:
  (d + 12) V per token) and the head's weight gradient, which the chunked head sums in float32
  (4 V h) adding one chunk's d-byte product in place (d V h), then casts to d bytes: (4 + d) V h;
- a block recomputed: its A x T (with any checkpointing or offloading), its unsharded gradient on
  the way to the reduce-scatter (d bytes as computed, the float32 cast, the float32 reduce-scatter
  input: (d + 8) x block), and the LM head's d-byte gradient, which waits for the root's
  reduce-scatter at the very end of backward.
With train.ep (expert parallelism, train/expert.py) the X expert parameters of the sparse layers
are held whole, X / ep per rank, and FSDP2 shards the other P - X over dp_shard: master
weights, gradients, moments and the step's temporary count (P - X) / dp_shard + X / ep. A block
is gathered without its experts, and in d < 4 bytes the rank's own experts of the running and
the prefetched block are cast to d bytes; its unsharded gradient is the non-expert part plus
X_l / ep; one MoE layer's all-to-all buffers (dispatch and combine, each sent and received:
4 T top_k h d bytes with balanced routing) join the block's backward moment. A sparse block
keeps 2 top_k h + 4 top_k I_e per token for its MLP instead of 4 i (train/model_shape.py).
The optimizer step runs after backward: shards, moments (optim_cpu_offload brings them back) and
one float32 temporary per trained tensor (foreach AdamW's square root of the second moment).
peak = max(forward/backward, optimizer step).

Between iterations a resident trainer whose engine shares its GPUs moves its state to host memory
and empties the allocator's cache (train/offload.py ResidentOffload); what stays during the
rollouts is TRAINER_RESIDUE_GIB (CUDA context, NCCL buffers, cuBLAS workspaces; measured from
outside with nvidia-smi on an H200, one rank, torch 2.11: 1382 MiB, of which the allocator keeps
64 MiB; tests/test_gpu_resident.py). With
train.offload_between_iterations=false nothing is moved or emptied: the allocator keeps the
step's reserved peak, so the whole `peak` stays beside the engine.

The fixed terms are estimates, not measurements: the trainer logs the device memory it still holds
after each offload, and the gpu test tier compares `peak` with a measured step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from train.context_rules import RING_QUERY_CHUNK
from train.model_shape import DTYPE_BYTES, GIB, ModelShape

TRAINER_OVERHEAD_GIB = 3.0
TRAINER_RESIDUE_GIB = 1.5

Rows = list[tuple[str, float]]


def _total(rows: Rows) -> float:
    return sum(b for _, b in rows)


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes per trainer process on its GPU, by component: `rows` are held through forward and
    backward, `head` and `block` are backward's two candidate moments, `peak` the largest moment."""

    rows: Rows
    head: Rows
    block: Rows
    step_peak: float
    notes: list[str]

    @property
    def forward_backward(self) -> float:
        return _total(self.rows) + max(_total(self.head), _total(self.block))

    @property
    def peak(self) -> float:
        return max(self.forward_backward, self.step_peak)


def _activations(shape: ModelShape, train: Any, d: int, tokens: int) -> tuple[float, float, str]:
    """(bytes kept from forward to backward, bytes of one block recomputed in backward, what)."""
    a = shape.block_activation_bytes(d)
    if train.attn == "eager":
        a += 2 * d * shape.heads * tokens
    cp = getattr(train, "cp", 1)
    if cp > 1 and getattr(train, "cp_kind", "ulysses") == "ring":
        # Per token of the rank's slice, about: float32 scaled queries, up to cp blocks' float32
        # outputs, merged outputs and logsumexps, and the cp - 1 kv slices received.
        a += 4 * shape.q_width * (1 + 2 * cp) + 8 * shape.heads * cp + 2 * (cp - 1) * d * shape.kv_width
    freq, n = train.ac.freq, shape.layers
    checkpointed = len(range(0, n, freq)) if freq else 0
    keep = d * shape.hidden
    if train.ac.mode == "selective":
        targets = set(train.ac.targets)
        if "attention" in targets:
            keep += d * shape.q_width
        if "matmul" in targets:
            keep += d * sum(b for _, b in shape.linear_shapes().values())
        if any(t.startswith("aten.") for t in targets):
            keep = a  # operators named one by one: assume they keep what the block keeps
    outside = (4 + 2 * d) * shape.hidden
    what = f"{checkpointed}/{n} blocks checkpointed ({train.ac.mode})" if checkpointed else "no checkpointing"
    if train.ac_offloading.enabled:
        inflight = train.ac_offloading.max_inflight_activations * d * max(shape.hidden, shape.intermediate)
        return (inflight + outside) * tokens, a * tokens, what + ", offloaded to host"
    kept = checkpointed * keep + (n - checkpointed) * a
    return (kept + outside) * tokens, (a if checkpointed else 0) * tokens, what


def trainer_memory(shape: ModelShape, train: Any, world_size: int, *, on_gpu: bool = True) -> TrainerMemory:
    """The estimate of the module docstring for one trainer process of `world_size`."""
    from train.chunked_head import resolve_chunk_size

    d = DTYPE_BYTES["bfloat16" if train.dtype == "auto" and on_gpu else
                    "float32" if train.dtype == "auto" else train.dtype]
    cast = 4 if d < 4 else 0  # bytes of a float32 copy made from a d-byte tensor (none when d is 4)
    fsdp = train.backend == "fsdp"
    shard = world_size // train.dp_replicate if fsdp else 1
    p, vh = shape.params, shape.vocab * shape.hidden
    trained = shape.lora_params(train.lora.rank, train.lora.target_modules) if train.lora.rank else p
    # train.ep (no LoRA with it): each rank keeps E/ep whole experts of every layer, FSDP2 shards the rest.
    ep = train.ep if fsdp and shape.experts else 1
    experts, layer_experts = (shape.all_expert_params, shape.expert_params) if ep > 1 else (0, 0)

    def per_rank(n: float) -> float:
        return (n - experts) / shard + experts / ep

    trained_block = trained / shape.layers if train.lora.rank else \
        shape.block_params - layer_experts + layer_experts / ep
    ep_note = f"; experts {shape.experts // ep} of {shape.experts} per layer, whole" if ep > 1 else ""
    head_trained = not train.lora.rank  # a LoRA policy's head is frozen (an adapted head is not chunked)
    host = fsdp and train.fsdp_cpu_offload
    on_host = " (on host)" if host else ""
    params = 0.0 if host else 4 * per_rank(p)
    rows: Rows = [(f"parameters: fp32 master, 1/{shard} shard{ep_note}{on_host}", params)]
    if fsdp:
        blocks = 2 if train.reshard_after_forward else shape.layers
        # Under ep the experts are not gathered; a d-byte copy of the rank's own is made for compute.
        rows.append((f"gathered parameters: {d}-byte root + {blocks} blocks" + (" without experts" if ep > 1 else ""),
                     d * (shape.root_params + blocks * (shape.block_params - layer_experts))))
        if ep > 1 and d < 4:
            rows.append((f"{d}-byte copies of this rank's experts of {blocks} blocks", d * blocks * layer_experts / ep))
        grads = 0.0 if host else 4 * per_rank(trained)
        rows.append((f"gradients: fp32, 1/{shard} shard{ep_note}{on_host}", grads))
    else:
        rows.append((f"autocast {d}-byte weight copies (DDP)", d * p if d < 4 else 0.0))
        grads = 8 * trained
        rows.append(("gradients: fp32 + DDP buckets", grads))
    optim = 0.0 if host else 8 * per_rank(trained)
    where = on_host or (" (on host between steps)" if train.optim_cpu_offload else "")
    rows.append((f"AdamW state: 2 x fp32, 1/{shard} shard{where}", 0.0 if train.optim_cpu_offload else optim))
    tokens, cp_label = _tokens_per_rank(train)
    kept, working, what = _activations(shape, train, d, tokens)
    rows.append((f"activations kept: {tokens} tokens{cp_label}, {what}", kept))
    reference = 0.0
    if train.kl_coef > 0:
        reference = 0.0 if host else 4 * per_rank(p)
        rows.append((f"KL reference: fp32, 1/{shard} shard{on_host}", reference))
        if fsdp:
            reference += d * shape.root_params
            rows.append((f"KL reference: {d}-byte root left gathered by its forward", d * shape.root_params))
    overhead = TRAINER_OVERHEAD_GIB * GIB
    rows.append(("CUDA context, NCCL, allocator (fixed)", overhead))

    chunk = resolve_chunk_size(train.fused_lm_head_token_chunk_size, shape.vocab)
    if chunk is None:
        head: Rows = [("LM head: all logits", (d + 12) * shape.vocab * tokens)]
        head_grad = d * vh
    else:
        head = [(f"LM head: chunks of {chunk} tokens", 3 * 4 * min(chunk, tokens) * shape.vocab + 8 * tokens)]
        head_grad = (4 + d) * vh
    if head_trained:
        head.append(("LM head weight gradient: fp32 sum + a chunk's product" if chunk else
                     f"LM head weight gradient: {d}-byte", head_grad))
    block: Rows = [("activations of the block recomputed", working)] if working else []
    if cp_label and getattr(train, "cp_kind", "ulysses") == "ring":
        rows_at_once = min(RING_QUERY_CHUNK, tokens)
        block.append((f"ring attention: {rows_at_once} queries' fp32 scores, probabilities and their gradients",
                      4 * 4 * shape.heads * rows_at_once * tokens))
    elif cp_label:
        block.append(("all-to-all buffers (ulysses): one layer's q, k, v or their gradients, sent and received",
                      2 * d * (shape.q_width + 2 * shape.kv_width) * tokens))
    if fsdp:
        block.append((f"its unsharded gradient: {d}-byte{', fp32 cast' if cast else ''}, fp32 reduce-scatter input",
                      (d + cast + 4) * trained_block))
        if head_trained:
            block.append((f"LM head's {d}-byte gradient, until the root's reduce-scatter", d * vh))
    if ep > 1:
        # Balanced routing: each of T x top_k rows of h values is sent and received once each way.
        block.append(("all-to-all buffers of one MoE layer: dispatch + combine, send + receive",
                      4 * tokens * shape.top_k * shape.hidden * d))

    # The step runs after the last backward: activations, gathered blocks and unsharded gradients are
    # freed by then, and optim_cpu_offload has brought the moments back to the device.
    temporaries = 0.0 if host else 4 * per_rank(trained)
    step = params + grads + optim + temporaries + reference + overhead
    notes = ["optim_cpu_offload: the optimizer state comes back to the device for each step"] \
        if train.optim_cpu_offload else []
    other = replace(train.ac, freq=0) if train.ac.freq else replace(train.ac, freq=1, mode="full")
    other_kept, _, other_what = _activations(shape, replace(train, ac=other), d, tokens)
    notes.append(f"activations kept with {other_what}: {other_kept / GIB:.2f} GiB")
    return TrainerMemory(rows, head, block, step, notes)


def _tokens_per_rank(train: Any) -> tuple[int, str]:
    """The positions of a micro-batch one rank holds: all of them, or 1/cp under context
    parallelism (train/context.py), which splits every activation along the tokens."""
    cp = getattr(train, "cp", 1)
    if cp == 1:
        return train.micro_batch_tokens, ""
    return -(-train.micro_batch_tokens // cp), f" (1/{cp} of {train.micro_batch_tokens}: context parallel)"


def rollout_residue(train: Any, trainer: TrainerMemory) -> tuple[str, float]:
    """(why, bytes) a trainer holds on a GPU it shares with the engine while the engine rolls out."""
    if not train.resident:
        return "none: train.resident=false ends the trainer after each iteration", 0.0
    if train.offload_between_iterations:
        return "CUDA context, NCCL buffers (its state offloaded)", TRAINER_RESIDUE_GIB * GIB
    return "its peak, kept reserved by train.offload_between_iterations=false", trainer.peak
