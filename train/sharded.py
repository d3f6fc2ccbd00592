"""Sharded model load and parallel publication (docs/design.md §11.4).

Load: the model is built with its parameters on the meta device (no host memory), the levers and
FSDP2 are applied to that skeleton, and only then is each rank's shard allocated and filled from
the Hugging Face safetensors files with torch.distributed.checkpoint's Hugging Face reader, which
reads exactly the slices a rank holds (`safe_open(...).get_slice`). A rank's host memory is its
shard plus one read buffer, never the whole model. Buffers (rotary frequencies) are computed in
host memory while the skeleton is built, as they are small and not in the weight files.

Publication: the trained parameters are assigned to the ranks in order, balanced by size. For
every parameter all ranks take part in one all-gather; only its owner keeps the full tensor, cast
to the serving dtype, and writes it into its own safetensors file. Each rank's buffer is therefore
its share of the published model (1/world of it), and every rank writes at the same time. The
file names and the index (`model.safetensors.index.json`) follow the Hugging Face convention, so
transformers and vLLM load the folder as it is. Each file carries the run id and iteration in its
metadata, and loading a checkpoint of this run checks them on the fd it reads from
(coordination/checkpoint_files.py).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from torch.futures import Future

from coordination.checkpoint_files import Stamp, check_stamp, open_listed, safetensors_header
from coordination.checkpoints import CheckpointError, stamp_of
from coordination.records import atomic_output
from train.expert import expert_writers
from train.expert_io import fill_experts, own_experts, per_expert_stored
from train.expert_layout import checkpoint_tensors, stored_name
from train.model import quiet_transformers

INDEX = "model.safetensors.index.json"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device at once; buffers stay real.
    (The same idea as accelerate's `init_empty_weights(include_buffers=False)`: buffers such as
    rotary frequencies are computed in __init__ and are absent from the weight files.)"""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def weight_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def can_load_sharded(folder: Path) -> bool:
    """Sharded load reads safetensors; a folder with only .bin weights goes through transformers."""
    return bool(weight_files(folder))


def open_weights(path: Path, owner: Stamp | None) -> int:
    """A read-only fd of weight file `path`. In a checkpoint (`owner`: its marker's stamp) the file
    is opened without following links, refused with a second name, and must carry the stamp; a
    base model's files (owner None) are the user's, links included (the Hugging Face cache)."""
    path = Path(path)
    if owner is None:
        return os.open(path, os.O_RDONLY)
    fd, _ = open_listed(path.parent, path.name, owner)
    try:
        check_stamp(fd, path, path.parent, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def stored_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file of `folder` that holds it (headers only)."""
    files: dict[str, Path] = {}
    owner = stamp_of(folder)
    for path in weight_files(folder):
        fd = open_weights(path, owner)
        try:
            files.update((k, path) for k in safetensors_header(fd, path)[0] if k != "__metadata__")
        finally:
            os.close(fd)
    return files


def stored_names(folder: Path) -> set[str]:
    """Tensor names in `folder`'s safetensors files (headers only)."""
    return set(stored_files(folder))


def per_expert_params(lm: nn.Module, stored: set[str], besides: frozenset[str] = frozenset()) -> dict[str, str]:
    """Stacked expert parameters of `lm` whose checkpoint stores one tensor per expert: the
    parameter name -> its weight-file key (train/expert_io.py reads them)."""
    model_type = getattr(lm.config, "model_type", "")
    return {n: file_key(n) for n, p in lm.named_parameters()
            if n not in besides and per_expert_stored(model_type, file_key(n), p.shape, stored)}


def missing_names(lm: nn.Module, folder: Path, besides: frozenset[str] = frozenset()) -> list[str]:
    """Parameters of `lm` (other than those named in `besides`) that `folder`'s files do not hold
    under the module's own names, nor (stacked experts) one tensor per expert (a model whose
    checkpoints use other names is loaded by transformers, which converts them)."""
    stored = stored_names(folder)
    experts = per_expert_params(lm, stored, besides)
    model_type = getattr(lm.config, "model_type", "")
    return sorted({stored_name(model_type, file_key(n)) for n, _ in lm.named_parameters()
                   if n not in besides and n not in experts} - stored)


def build_on_meta(folder: Path, attn: str) -> nn.Module:
    """The model of `folder`'s config.json with float32 parameters on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except OSError as exc:
        raise FileNotFoundError(f"cannot load a model from {folder}: {exc}") from None
    with parameters_on_meta():
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
    lm.tie_weights()
    return lm


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _pread_reader(owner: Stamp | None):
    """DCP's Hugging Face reader, reading each request's rows with pread instead of through a
    memory map: a mapped file's touched pages count in the process's RSS for as long as it is
    open, which made a rank's peak look like the whole file; pread copies only the requested
    rows into one buffer. Requests that slice beyond dim 0 (not FSDP2's layout) go through
    safetensors as before. Each file is opened by `open_weights` (a checkpoint's: no link, no
    second name, `owner`'s stamp), so the bytes read are the ones checked."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class PreadReader(HuggingFaceStorageReader):
        def read_data(self, plan, planner):
            per_file: dict[str, list] = {}
            for req in plan.items:
                per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
            for file_name, reqs in per_file.items():
                fd = open_weights(Path(file_name), owner)
                try:
                    header, data_start = safetensors_header(fd, file_name)
                    for req in reqs:
                        self._pread(fd, header, data_start, req, planner)
                finally:
                    os.close(fd)
            fut: Future = Future()
            fut.set_result(None)
            return fut

        def _pread(self, fd, header, data_start, req, planner) -> None:
            entry = header[req.storage_index.fqn]
            shape, dtype = entry["shape"], _DTYPES.get(entry["dtype"])
            rest_full = all(o == 0 and n == full for o, n, full in
                            zip(req.storage_offsets[1:], req.lengths[1:], shape[1:]))
            if dtype is None or not shape or not rest_full:
                from safetensors import safe_open

                with safe_open(self.storage_data[req.storage_index].relative_path, framework="pt") as f:
                    self._process_read_request(f, req, planner)
                return
            row = math.prod(shape[1:]) * dtype.itemsize
            begin = data_start + entry["data_offsets"][0] + req.storage_offsets[0] * row
            buf = bytearray(req.lengths[0] * row)
            if buf and os.preadv(fd, [buf], begin) != len(buf):
                raise CheckpointError(f"{self.storage_data[req.storage_index].relative_path} is shorter than its "
                                      f"header says ({req.storage_index.fqn}); the file is truncated")
            tensor = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            target = planner.resolve_tensor(req).detach()
            target.copy_(tensor.reshape(list(req.lengths)))
            planner.commit_tensor(req, target)

    return PreadReader


def file_key(name: str) -> str:
    """The weight-file key of a parameter name of the policy's `lm` (peft's `.base_layer` removed)."""
    return name.replace(".base_layer.", ".")


def materialize(policy, folder: Path, device: torch.device, extra: dict[str, torch.Tensor] | None = None) -> int:
    """Collective: allocate the (sharded) parameters of a meta-built `policy` on `device` and fill
    them from `folder`'s safetensors, except those `extra` holds (full values under the names of
    `policy.lm`'s parameters: LoRA adapters, which are not in the base model's files), which are
    copied in, each rank its slice. Returns the number of tensors read. Buffers keep the values
    computed at build time."""
    import torch.distributed.checkpoint as dcp

    buffers = {n: b.detach().clone() for n, b in policy.named_buffers()}
    first: dict[int, str] = {}
    tied = {n: first.setdefault(id(p), n) for n, p in policy.named_parameters(remove_duplicate=False)}
    policy.to_empty(device=device)
    # to_empty replaces each module's parameter on its own, which unties shared ones (a tied LM
    # head); FSDP2 keeps one parameter per tensor, so this only acts on unsharded modules.
    current = dict(policy.named_parameters(remove_duplicate=False))
    for name, owner in tied.items():
        if name != owner and current[name] is not current[owner]:
            module_name, _, attr = name.rpartition(".")
            setattr(policy.get_submodule(module_name), attr, current[owner])
    with torch.no_grad():
        for n, b in policy.named_buffers():
            b.copy_(buffers[n])
    extra = extra or {}
    named = dict(policy.lm.named_parameters())
    if set(extra) - set(named):
        raise ValueError(f"no parameters {sorted(set(extra) - set(named))[:3]} in the model to fill")
    for name, value in extra.items():
        place_full(named[name], value)
    files = stored_files(folder)
    experts = per_expert_params(policy.lm, set(files), frozenset(extra))
    model_type = getattr(policy.lm.config, "model_type", "")
    targets = {stored_name(model_type, file_key(n)): p for n, p in named.items() if n not in extra and n not in experts}
    missing = missing_names(policy.lm, folder, frozenset(extra))
    if missing:
        raise CheckpointError(f"{folder} has no weights for {missing[:3]} ({len(missing)} missing); it is not a "
                              f"checkpoint of this model (config.json and the safetensors files disagree)")
    # DCP's planner fills DTensors (FSDP2 shards) and plain tensors (DDP) in place, reading only
    # the slices each rank holds; the file's dtype (bf16 after a publication) is cast on copy.
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(dict(targets), storage_reader=_pread_reader(stamp_of(folder))(str(folder)))
    except CheckpointException as exc:  # a BaseException: make it the trainer's reported failure
        raise CheckpointError(f"cannot load the weights of {folder}: {exc}; check that config.json and the "
                              f"safetensors files belong to the same model") from None
    if experts:
        fill_experts(model_type, {k: named[n] for n, k in experts.items()}, files,
                     open_weights, stamp_of(folder))
    return len(targets) + len(experts)


def place_full(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the full tensor `value` into `param`: all of it into a plain tensor, this rank's slice
    into a DTensor (FSDP2's shard: the same slicing as the sharding, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            local = distribute_tensor(value, param.device_mesh, param.placements,
                                      src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(value)


def owners(sizes: list[int], world_size: int) -> list[int]:
    """Rank that writes each tensor: contiguous runs in order, balanced by bytes (greedy)."""
    total = sum(sizes) or 1
    out, acc = [], 0
    for s in sizes:
        out.append(min(world_size - 1, int(acc * world_size / total)))
        acc += s
    return out


def shard_name(rank: int, world_size: int) -> str:
    """Hugging Face's shard naming (model-00001-of-00002.safetensors); one file per rank."""
    if world_size == 1:
        return "model.safetensors"
    return f"model-{rank + 1:05d}-of-{world_size:05d}.safetensors"


def published_names(policy) -> list[tuple[str, torch.Tensor]]:
    """(HF name, parameter or buffer) of every tensor the published folder holds: tied weights
    once (under the first name), persistent buffers included, in the module's order. With LoRA
    the adapters are left out and the base layers keep their plain names (`file_key`)."""
    lm = policy.lm
    non_persistent = {f"{m}.{b}" if m else b for m, mod in lm.named_modules()
                      for b in getattr(mod, "_non_persistent_buffers_set", ())}
    named = list(lm.named_parameters()) + [(n, b) for n, b in lm.named_buffers() if n not in non_persistent]
    return [(n, t) for n, t in named if ".lora_" not in n]


@dataclass
class Share:
    """What one rank publishes: its tensors (already in the serving dtype, on the CPU), the file it
    writes them to (None when it owns nothing), every weight file's name, and the index for rank 0."""
    tensors: dict[str, torch.Tensor]
    file: str | None
    files: list[str]
    index: dict | None


def _full(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Collective for a DTensor (every rank must call it, in the same order). With `dtype` a
    floating-point DTensor's local shard is cast first, so the all-gather moves serving-dtype bytes
    (half of float32's for bf16); the cast is elementwise, so the result is the same bits as
    casting after the gather."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.full_tensor()


def gather_share(policy, rank: int, world_size: int, dtype: torch.dtype, merge: dict | None = None) -> Share:
    """Collective: gather the full tensors this rank publishes. Every rank takes part in the
    all-gather of each sharded tensor, in the same order; only its owner keeps the result, so a
    rank holds its share of the published model (about 1/world of it) plus one tensor in flight.
    `merge` (train.lora.merge_sources): base weight name -> how its LoRA adapters merge into it;
    the owner gathers that layer's adapters too and publishes the merged weight."""
    model_type = getattr(policy.lm.config, "model_type", "")
    params = dict(policy.lm.named_parameters())
    merge = merge or {}
    # Experts sharded by expert parallelism are written by the ranks that hold them, ungathered.
    experts = {n: w for n, t in published_names(policy) if (w := expert_writers(t)) is not None}
    named = [(n, t) for n, t in published_names(policy) if n not in experts]
    sizes = [t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for _, t in named]
    owner = owners(sizes, world_size)
    writers = sorted(set(owner) | {r for ranks in experts.values() for r in ranks})
    file_of = {r: shard_name(i, len(writers)) for i, r in enumerate(writers)}
    mine: dict[str, torch.Tensor] = {}
    for (name, t), o in zip(named, owner):
        source = merge.get(name)
        full = _full(t, None if source is not None else dtype)  # a merged weight is summed in float32 first
        if source is not None:
            a, b = _full(params[source.a]), _full(params[source.b])
            if o == rank:
                full = source.merged(full, a, b)
            del a, b
        if o == rank:
            # Stacked experts are published one tensor per expert, the layout vLLM reads.
            for key, value in checkpoint_tensors(model_type, file_key(name), full.detach()):
                mine[key] = value.to(device="cpu", dtype=dtype if value.is_floating_point()
                                     else value.dtype).contiguous()
        del full
    mine.update(own_experts(model_type, {file_key(n): params[n] for n in experts}, dtype))
    files = [file_of[r] for r in writers]
    index = None
    if len(writers) > 1:
        weight_map = {key: file_of[o] for (name, t), o in zip(named, owner)
                      for key, _ in checkpoint_tensors(model_type, file_key(name), torch.empty(t.shape, device="meta"))}
        for name, ranks in experts.items():
            one = torch.empty((1, *params[name].shape[1:]), device="meta")
            weight_map.update((key, file_of[r]) for e, r in enumerate(ranks)
                              for key, _ in checkpoint_tensors(model_type, file_key(name), one, e))
        expert_size = sum(params[n].numel() * dtype.itemsize for n in experts)
        index = {"metadata": {"total_size": sum(sizes) + expert_size}, "weight_map": weight_map}
        files.append(INDEX)
    return Share(mine, file_of.get(rank), files, index)


def gather_adapters(policy, rank: int) -> dict[str, torch.Tensor]:
    """Collective: the full LoRA adapter tensors (names of the policy's `lm`) on rank 0, {} elsewhere."""
    out: dict[str, torch.Tensor] = {}
    for name, p in policy.lm.named_parameters():
        if ".lora_" in name:
            full = _full(p)
            if rank == 0:
                out[name] = full.detach().to("cpu").contiguous()
    return out


def write_share(share: Share, out: Path, rank: int, stamp: Stamp) -> None:
    """This rank's weight file (and on rank 0 the index), each written whole and renamed into place.
    The weights carry `stamp` (this run and iteration) in their metadata, which loading checks."""
    from safetensors.torch import save_file

    if share.file is not None:
        with atomic_output(Path(out) / share.file) as tmp:
            save_file(share.tensors, str(tmp), metadata={"format": "pt", **stamp.metadata()})
    if rank == 0 and share.index is not None:
        with atomic_output(Path(out) / INDEX) as tmp:
            Path(tmp).write_text(json.dumps(share.index, indent=2, sort_keys=True) + "\n")


def write_config(policy, out: Path, dtype: torch.dtype) -> None:
    """config.json (its dtype says what the weights are stored in) and generation_config.json."""
    config = copy.deepcopy(policy.lm.config)
    config.dtype = dtype
    config.save_pretrained(str(out))
    gen = getattr(policy.lm, "generation_config", None)
    if gen is not None and policy.lm.can_generate():
        gen.save_pretrained(str(out))
