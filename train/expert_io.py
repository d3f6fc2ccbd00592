"""Reading and writing a rank's experts: the sharded load and the publication of stacked experts
in a checkpoint that stores one tensor per expert.

A Hugging Face MoE checkpoint holds `<layer>.experts.<e>.gate_proj.weight` and friends
(train/expert_layout.py); the model holds one stacked tensor per layer and kind. Each rank reads
only the experts its shard of a stacked tensor covers: under expert parallelism its E/ep whole
experts, under plain FSDP2 its rows of dim 0, under DDP all of them. Nothing else is read, so no
rank holds every expert of a layer unless its shard does. Publication under expert parallelism
is the reverse: each rank of the first EP group writes the experts it holds, ungathered.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from coordination.checkpoint_files import Stamp, safetensors_header
from coordination.checkpoints import CheckpointError
from train.expert import publishes_own_experts
from train.expert_layout import checkpoint_tensors, is_stacked_expert

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checkpoint_names(model_type: str, name: str, shape: torch.Size) -> list[str]:
    """The names a model tensor of this shape is stored under in a Hugging Face checkpoint."""
    return [k for k, _ in checkpoint_tensors(model_type, name, torch.empty(shape, device="meta"))]


def per_expert_stored(model_type: str, name: str, shape: torch.Size, stored: set[str]) -> bool:
    """Whether the stacked expert tensor `name` is stored one tensor per expert (not stacked)."""
    if not is_stacked_expert(name) or name in stored:
        return False
    names = checkpoint_names(model_type, name, shape)
    return names != [name] and all(n in stored for n in names)


def local_rows(param: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first expert, this rank's tensor) of a stacked expert parameter: its DTensor shard, or all."""
    if not isinstance(param, DTensor):
        return 0, param.detach()
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], param.to_local().detach()


def fill_experts(model_type: str, params: dict[str, torch.Tensor], files: dict[str, Path],
                 open_file, owner: Stamp | None) -> int:
    """Fill each stacked expert parameter (`params`: checkpoint-side name -> parameter) with the
    experts of its local shard, read with pread from the files that hold them (`files`: stored
    name -> file; `open_file(path, owner)` gives a checked fd). Returns the tensors read."""
    wanted: dict[Path, list[tuple[str, torch.Tensor, int]]] = {}
    for name, param in params.items():
        first, local = local_rows(param)
        for stored, _ in checkpoint_tensors(model_type, name, torch.empty(local.shape, device="meta"), first):
            wanted.setdefault(files[stored], []).append((stored, local, first))
    values: dict[str, torch.Tensor] = {}
    for path, entries in wanted.items():
        fd = open_file(path, owner)
        try:
            header, start = safetensors_header(fd, path)
            for stored, _, _ in entries:
                values[stored] = _read(fd, header, start, stored, path)
        finally:
            os.close(fd)
    with torch.no_grad():
        for name, param in params.items():
            first, local = local_rows(param)
            for i in range(local.shape[0]):
                parts = checkpoint_tensors(model_type, name, torch.empty((1, *local.shape[1:]), device="meta"),
                                           first + i)
                local[i].copy_(torch.cat([values[k] for k, _ in parts], dim=0))
    return len(values)


def own_experts(model_type: str, params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The per-expert tensors (on the CPU, in `dtype`) this rank publishes of the EP-sharded
    stacked expert parameters `params` (checkpoint-side name -> parameter)."""
    out = {}
    for name, param in params.items():
        if publishes_own_experts(param):
            first, local = local_rows(param)
            out.update((key, value.to(device="cpu", dtype=dtype).contiguous())
                       for key, value in checkpoint_tensors(model_type, name, local, first))
    return out


def _read(fd: int, header: dict, start: int, name: str, path: Path) -> torch.Tensor:
    entry = header[name]
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointError(f"{path}: {name} is stored as {entry['dtype']}, not a floating-point type the "
                              f"experts can hold; the file does not belong to this model")
    begin, end = entry["data_offsets"]
    buf = bytearray(end - begin)
    if buf and os.preadv(fd, [buf], start + begin) != len(buf):
        raise CheckpointError(f"{path} is shorter than its header says ({name}); the file is truncated")
    if len(buf) != math.prod(entry["shape"]) * dtype.itemsize:
        raise CheckpointError(f"{path}: {name}'s size does not match its shape; the file is damaged")
    return torch.frombuffer(buf, dtype=dtype).reshape(entry["shape"]).to(torch.float32)
