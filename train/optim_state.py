"""Optimizer state beside a checkpoint: one safetensors + JSON pair per trainer rank, no pickle.

Every rank writes the state of the parameter rows it holds: with FSDP2 its dim-0 shard of each
parameter, with DDP the whole tensor (so every DDP file is a full copy). The JSON record names,
for each parameter, its global shape, the row range [start, stop) the file holds, the names of
its tensor states (exp_avg, exp_avg_sq for AdamW) and its scalar states (step).

Loading reshards: each rank computes the rows it holds now and reads exactly those rows from
whichever saved files cover them (safetensors reads slices without loading whole files). So a
checkpoint saved by 2 FSDP ranks loads into 1, 3 or 4 ranks, or into DDP, and the reverse.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import torch

from coordination.records import atomic_output, publish_record, read_record, NotThereYet
from coordination.checkpoints import CheckpointError, OPTIMIZER_DIR

NamedParams = Iterable[tuple[str, torch.nn.Parameter]]


def shard_paths(folder: Path, rank: int) -> tuple[Path, Path]:
    base = Path(folder) / OPTIMIZER_DIR
    return base / f"rank-{rank}.safetensors", base / f"rank-{rank}.json"


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """Rows [start, stop) of dim 0 of the global parameter that this rank's local tensor holds."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor) or param.ndim == 0:
        return 0, (param.shape[0] if param.ndim else 1)
    n = param.shape[0]
    start, stop = 0, n
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_replicate():
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0):
            raise CheckpointError(f"optimizer state of a parameter placed as {param.placements} cannot be saved; "
                                  f"only dim-0 sharding (FSDP2) and replication are supported")
        chunks, index = param.device_mesh.size(mesh_dim), param.device_mesh.get_coordinate()[mesh_dim]
        size = math.ceil((stop - start) / chunks)  # torch.chunk semantics, as FSDP2 shards
        start, stop = min(start + index * size, stop), min(start + (index + 1) * size, stop)
    local = param.to_local().shape[0]
    if stop - start != local:
        raise CheckpointError(f"cannot locate this rank's shard: computed rows [{start}, {stop}) but the local "
                              f"tensor has {local} rows; the sharding layout is not the one this code expects")
    return start, stop


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def save_optimizer_shard(folder: Path, optimizer: torch.optim.Optimizer, named_params: NamedParams, *,
                         rank: int, world_size: int, backend: str, run_id: str) -> None:
    """Write this rank's optimizer state into `folder/optimizer/`."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    params: dict[str, Any] = {}
    for name, p in named_params:
        state = optimizer.state.get(p)
        if not state:
            continue
        entry: dict[str, Any] = {"shape": list(p.shape), "rows": list(local_rows(p)), "tensors": [], "scalars": {}}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and tuple(value.shape) == tuple(p.shape):
                tensors[f"{name}::{key}"] = _local(value).detach().to("cpu").contiguous()
                entry["tensors"].append(key)
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                entry["scalars"][key] = {"value": float(value.item()), "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                raise CheckpointError(f"optimizer state {key!r} of {name} ({type(value).__name__}) has no safe format")
        params[name] = entry
    data_path, meta_path = shard_paths(folder, rank)
    with atomic_output(data_path) as tmp:
        save_file(tensors, str(tmp))
    publish_record(meta_path, "optimizer-shard", {"rank": rank, "world_size": world_size, "backend": backend,
                                                  "params": params}, run_id=run_id, generation=0)


def _saved_shards(folder: Path, world_size: int) -> list[tuple[Path, dict]]:
    out = []
    for r in range(world_size):
        data_path, meta_path = shard_paths(folder, r)
        try:
            rec = read_record(meta_path, kind="optimizer-shard")
        except NotThereYet as exc:
            raise CheckpointError(f"optimizer state of {folder} is incomplete: {exc}; the checkpoint was not "
                                  f"written by a finished training attempt") from None
        if not data_path.exists():
            raise CheckpointError(f"optimizer state file {data_path} is missing")
        out.append((data_path, rec.data))
    return out


def _read_rows(shards: list[tuple[Path, dict]], name: str, key: str, shape: list[int],
               rows: tuple[int, int], handles: dict) -> torch.Tensor:
    """Rows [start, stop) of saved state `key` of parameter `name`, gathered from the files that hold them."""
    from safetensors import safe_open

    start, stop = rows
    if not shape:  # a scalar parameter is never sharded: any file holding it will do
        path = next((path for path, data in shards if name in data["params"]), None)
        if path is None:
            raise CheckpointError(f"no saved optimizer shard holds {name}.{key}")
        return safe_open(str(path), framework="pt").get_tensor(f"{name}::{key}")
    if start == stop:  # FSDP2 gives trailing ranks empty shards when a dim 0 is short
        return torch.zeros((0, *shape[1:]))
    pieces, at = [], start
    while at < stop:
        found = next(((path, data["params"][name]) for path, data in shards
                      if name in data["params"] and key in data["params"][name]["tensors"]
                      and data["params"][name]["rows"][0] <= at < data["params"][name]["rows"][1]), None)
        if found is None:
            raise CheckpointError(f"no saved optimizer shard holds row {at} of {name}.{key}; "
                                  f"the optimizer folder is incomplete")
        path, entry = found
        if entry["shape"] != shape:
            raise CheckpointError(f"optimizer state of {name} has shape {entry['shape']} but the model's parameter "
                                  f"has {shape}; this optimizer state belongs to another model")
        end, first = min(stop, entry["rows"][1]), entry["rows"][0]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        pieces.append(handles[path].get_slice(f"{name}::{key}")[at - first:end - first])
        at = end
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def load_optimizer_state(folder: Path, optimizer: torch.optim.Optimizer, named_params: NamedParams, *,
                         saved_world_size: int) -> int:
    """Fill `optimizer.state` from `folder/optimizer/`, resharding to this rank's rows.
    Returns the number of parameters restored."""
    from torch.distributed.tensor import DTensor

    shards = _saved_shards(folder, saved_world_size)
    named = list(named_params)
    saved_names = set().union(*(d["params"].keys() for _, d in shards)) if shards else set()
    missing = [n for n, _ in named if n not in saved_names]
    if saved_names and missing:
        raise CheckpointError(f"optimizer state in {folder} lacks parameters {missing[:3]}; it belongs to another "
                              f"model or parameter set (LoRA on/off?). Remove {folder / OPTIMIZER_DIR} to start "
                              f"a fresh optimizer")
    handles: dict = {}
    restored = 0
    for name, p in named:
        entry = next((d["params"][name] for _, d in shards if name in d["params"]), None)
        if entry is None:
            continue
        rows = local_rows(p)
        state: dict[str, torch.Tensor] = {}
        for key in entry["tensors"]:
            piece = _read_rows(shards, name, key, list(p.shape), rows, handles)
            value = torch.zeros_like(p, memory_format=torch.contiguous_format)
            target = value.to_local() if isinstance(value, DTensor) else value
            with torch.no_grad():
                target.copy_(piece.to(device=target.device, dtype=target.dtype).reshape(target.shape))
            state[key] = value
        for key, scalar in entry["scalars"].items():
            state[key] = torch.tensor(scalar["value"], dtype=getattr(torch, scalar["dtype"]))
        optimizer.state[p] = state
        restored += 1
    return restored
