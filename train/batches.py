"""Training shards (one Parquet file per trainer rank) and the tensors of a micro-batch.

A shard row is one episode placed in (step, micro_batch) by the plan: prompt and completion
token ids, the sampling logprob of each completion token, the loss mask (1 on the policy's
tokens, 0 on template and environment tokens) and its advantage, which applies to every policy
token of the episode. A rank reads only
its own shard and checks it against the plan's SHA-256 before use.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from coordination.records import atomic_output

SHARD_SCHEMA = pa.schema([
    pa.field("step", pa.int32(), nullable=False),
    pa.field("micro_batch", pa.int32(), nullable=False),
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("advantage", pa.float32(), nullable=False),
])


class ShardError(RuntimeError):
    """A training shard that is missing, altered or unreadable; the message says how to recover."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_shard(path: Path, rows: list[dict[str, Any]]) -> str:
    """Publish a shard atomically; returns its SHA-256."""
    table = pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)
    with atomic_output(Path(path)) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return sha256_of(path)


def read_shard(path: Path, sha256: str) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(step, micro_batch) -> rows of this rank's shard, after checking the file is the planned one."""
    path = Path(path)
    fix = "rerun phase 8 (prepare training data) to rewrite it; it is rebuilt from the iteration's all.parquet"
    try:
        actual = sha256_of(path)
    except FileNotFoundError:
        raise ShardError(f"training shard {path} does not exist; {fix}") from None
    if actual != sha256:
        raise ShardError(f"training shard {path} is not the file the plan describes (sha256 {actual[:12]} "
                         f"instead of {sha256[:12]}): it was altered or is corrupt; {fix}")
    try:
        table = pq.read_table(path, schema=SHARD_SCHEMA)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ShardError(f"training shard {path} is unreadable ({exc}); {fix}") from None
    out: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for row in table.to_pylist():
        out[(row["step"], row["micro_batch"])].append(row)
    return dict(out)


@dataclass
class MicroBatch:
    """Right-padded tensors of one micro-batch. Position t of the [B, T-1] tensors is the
    prediction of input token t+1; `loss_mask` is 1 exactly on the policy's completion tokens."""

    input_ids: Any
    attention_mask: Any
    targets: Any
    loss_mask: Any
    old_logprobs: Any
    advantages: Any

    @property
    def completion_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    def to(self, device) -> "MicroBatch":
        return MicroBatch(*(t.to(device, non_blocking=True) for t in
                            (self.input_ids, self.attention_mask, self.targets, self.loss_mask,
                             self.old_logprobs, self.advantages)))


def collate(rows: list[dict[str, Any]], pad_id: int) -> MicroBatch:
    """Rows with prompt_ids, completion_ids and optionally logprobs, loss_mask and advantage -> a
    MicroBatch. Rows without logprobs (SFT) get zeros; rows without a loss mask train on every
    completion token (SFT examples are all policy); rows without an advantage get 1."""
    import torch

    if not rows:
        return empty_micro_batch(pad_id)
    width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width - 1), dtype=torch.float32)
    old = torch.zeros((b, width - 1), dtype=torch.float32)
    adv = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, r in enumerate(rows):
        p, c = len(r["prompt_ids"]), len(r["completion_ids"])
        if p < 1:
            raise ValueError(f"sample {r.get('task_id')}/{r.get('sample_index')} has an empty prompt; "
                             f"every prompt needs at least one token (a BOS) to predict from")
        input_ids[i, :p + c] = torch.tensor(list(r["prompt_ids"]) + list(r["completion_ids"]), dtype=torch.long)
        attention[i, :p + c] = 1
        mask = r.get("loss_mask")
        if mask is None:
            loss_mask[i, p - 1:p - 1 + c] = 1.0
        elif len(mask) != c:
            raise ValueError(f"sample {r.get('task_id')}/{r.get('sample_index')} has {c} completion tokens but "
                             f"{len(mask)} loss mask entries; the trajectory is broken")
        else:
            loss_mask[i, p - 1:p - 1 + c] = torch.tensor(list(mask), dtype=torch.float32)
        if r.get("logprobs") is not None:
            old[i, p - 1:p - 1 + c] = torch.tensor(r["logprobs"], dtype=torch.float32)
        adv[i, :] = float(r.get("advantage", 1.0))
    return MicroBatch(input_ids, attention, input_ids[:, 1:].clone(), loss_mask, old, adv)


def empty_micro_batch(pad_id: int) -> MicroBatch:
    """A micro-batch that contributes nothing: run by a rank with fewer micro-batches than its
    peers, so that the collectives inside forward/backward still line up."""
    import torch

    ids = torch.full((1, 2), pad_id, dtype=torch.long)
    zeros = torch.zeros((1, 1), dtype=torch.float32)
    # Attention stays on: a fully masked row gives NaN attention, and NaN * 0 is still NaN.
    return MicroBatch(ids, torch.ones_like(ids), ids[:, 1:].clone(), zeros, zeros.clone(), zeros.clone())
