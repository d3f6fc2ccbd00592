"""Optimizer state beside a checkpoint through torch's Distributed Checkpoint (docs/design.md §11.4).

`get_optimizer_state_dict` gives the state under parameter names (FQNs of the policy module), as
DTensors under FSDP2 and plain tensors under DDP; `dcp.save` writes it with DCP's Hugging Face
storage writer in distributed mode: every rank writes the pieces it holds into its own
safetensors file (`optimizer/shard-0000R-model-00001-of-00001.safetensors`), and each file's
header records where its pieces sit in the global tensors. No other metadata file is written,
so nothing in the folder is a pickle (docs/design.md §5 rule 11).

Loading reshards: DCP's Hugging Face reader rebuilds the global layout from those headers, and
`dcp.load` reads exactly the slices each rank now holds, so state saved by 2 ranks loads into 1
or 4, or into DDP, and the reverse. `set_optimizer_state_dict` puts it into the optimizer.
Only tensors are saved (AdamW: exp_avg, exp_avg_sq, step); the hyperparameters come from the
config of the run that resumes.

DCP fixes the metadata of the files it writes, so the writer's file streams add the run and
iteration (`Stamp`) to each file's header as it is written (`_stamping_writer`), and loading
checks every shard against the checkpoint's marker first (coordination/checkpoint_files.py).
"""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from coordination.checkpoint_files import Stamp, check_stamp, open_listed, stamped
from coordination.checkpoints import CheckpointError, OPTIMIZER_DIR, stamp_of
from coordination.records import own_opener

SEP = "::"
# The key suffix of a trained parameter's own value in the shards: the trainer's float32 state. The
# published weights are in the serving dtype (bf16 on GPU), which rounds away every update smaller
# than half a bf16 step of the weight; a trainer that continues from them loses that progress at
# every reload (docs/design.md §9.6). So the shards hold, beside AdamW's moments, the float32
# value of every parameter the optimizer trains, and a load continues from it.
MASTER = "master"


def optimizer_dir(folder: Path) -> Path:
    return Path(folder) / OPTIMIZER_DIR


def shard_file(rank: int) -> str:
    """The file rank `rank` writes under optimizer/ (DCP's Hugging Face writer's naming, shard index
    rank + 1, one file per rank); a rank that holds nothing to write (DDP replicas after DCP's
    de-duplication) writes none."""
    from torch.distributed.checkpoint._hf_utils import _gen_file_name

    return _gen_file_name(1, 1, rank + 1)


def _flat(model: nn.Module, optimizer: torch.optim.Optimizer, *, master: bool = True
          ) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor]]:
    """(name::state -> tensor, the optimizer state dict they belong to, the trained parameters'
    values by name). A fresh optimizer's state is initialised by get_optimizer_state_dict, so
    loading has tensors to fill in place. With `master` the flat dict also holds name::MASTER, the
    value of every parameter the optimizer trains: the model's state-dict tensors, no copy (an
    asynchronous save copies them to host memory itself; a load fills them, and
    `set_model_state_dict` then makes sure the model holds what was loaded)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer)
    flat = {}
    for fqn, state in sd["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {key!r} of {fqn} is a {type(value).__name__}, not a tensor; "
                                      f"it has no safetensors format")
            flat[f"{fqn}{SEP}{key}"] = value
    values: dict[str, torch.Tensor] = {}
    if master:
        params = get_model_state_dict(model)
        for fqn in sd["state"]:
            values[fqn] = params[fqn]
            flat[f"{fqn}{SEP}{MASTER}"] = values[fqn]
    return flat, sd, values


class _StampingStream:
    """A shard file being written: DCP writes it in one call (safetensors.torch.save's bytes), which
    this writes out with `stamp` added to the header. A second call would be a DCP that writes
    otherwise, refused rather than left unstamped."""

    def __init__(self, raw, stamp: Stamp, path) -> None:
        self._raw, self._stamp, self._path, self._written = raw, stamp, path, False

    def write(self, data) -> int:
        if self._written:
            raise CheckpointError(f"DCP wrote {self._path} in more than one piece; this torch version's writer "
                                  f"cannot be stamped with the run's id: use the torch version requirements.txt pins")
        self._written = True
        head, body = stamped(data, self._stamp)
        self._raw.write(head)
        self._raw.write(body)
        return len(memoryview(data))

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self._raw, name)


def _stamping_writer(path: Path, stamp: Stamp):
    """DCP's Hugging Face writer in distributed mode whose shard files carry `stamp` and are created
    through `own_opener` (never through a link planted in the folder)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class StampingFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, file, mode):
            if "w" not in mode or not str(file).endswith(".safetensors"):
                with super().create_stream(file, mode) as stream:
                    yield stream
                return
            with open(file, mode, opener=own_opener) as raw:
                yield _StampingStream(raw, stamp, file)

    writer = HuggingFaceStorageWriter(str(path), save_distributed=True)
    writer.fs = StampingFileSystem()
    return writer


def has_state(optimizer: torch.optim.Optimizer) -> bool:
    return any(bool(s) for s in optimizer.state.values())


def save_optimizer_state(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                         stamp: Stamp) -> bool:
    """Collective: write the optimizer state of `model`'s parameters into `folder/optimizer/`, each
    file stamped with `stamp` (the checkpoint's run and iteration). Returns whether this rank wrote
    a file (DCP writes a replicated tensor once)."""
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    flat, _, _ = _flat(model, optimizer)
    out = optimizer_dir(folder)
    try:
        dcp.save(flat, storage_writer=_stamping_writer(out, stamp))
    except CheckpointException as exc:  # a BaseException: make it the trainer's reported failure
        raise CheckpointError(f"writing the optimizer state to {out} failed: {exc}") from None
    return (out / shard_file(rank)).exists()


def check_shards(folder: Path) -> list[str]:
    """The safetensors files in `folder/optimizer/` (what DCP's reader reads: the whole folder). In a
    checkpoint of this run each is opened without links, with one name, and must carry the
    checkpoint's run and iteration (`stamp_of`: its marker's); headers only, nothing is hashed."""
    src = optimizer_dir(folder)
    owner = stamp_of(folder)
    names = sorted(n for n in os.listdir(src) if n.endswith(".safetensors")) if src.is_dir() else []
    for name in names if owner is not None else ():
        fd, _ = open_listed(src, name, owner)
        try:
            check_stamp(fd, src / name, folder, owner)
        finally:
            os.close(fd)
    return names


def load_optimizer_state(folder: Path, optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[int, bool]:
    """Collective: fill `optimizer` from `folder/optimizer/` of the complete checkpoint `folder`,
    resharded to this rank's slices, and, when the shards hold it, the trained parameters with
    their float32 state (MASTER) in place of the published weights they were loaded from. Returns
    (the number of parameters restored, whether their float32 state was)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    src = optimizer_dir(folder)
    if not any(n.startswith("shard-") for n in check_shards(folder)):
        raise CheckpointError(f"{src} holds no optimizer state written by this version of baton (DCP shard files); "
                              f"remove {src} to start a fresh optimizer, or restore the checkpoint")
    from torch.distributed.checkpoint.api import CheckpointException

    reader = HuggingFaceStorageReader(str(src))
    stored = reader.read_metadata().state_dict_metadata
    flat, sd, values = _flat(model, optimizer, master=any(k.endswith(SEP + MASTER) for k in stored))
    try:
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(src)))
    except (CheckpointException, RuntimeError) as exc:  # DCP's (a BaseException) gathers every rank's failure
        raise CheckpointError(f"cannot load the optimizer state in {src}: {exc}. It belongs to another model or "
                              f"parameter set (LoRA on/off?) or is incomplete; remove {src} to start a fresh "
                              f"optimizer") from None
    set_optimizer_state_dict(model, optimizer, sd)
    if values:
        set_model_state_dict(model, values, options=StateDictOptions(strict=False))
    return len(sd["state"]), bool(values)


class OptimizerWrite:
    """The optimizer state of one iteration (stamped with `stamp`) on its way to disk while the
    trainer goes on (a resident trainer, docs/design.md §9.6): `dcp.async_save` copies the state to host memory
    before it returns (so the next steps, or an offload, may change the originals), then a
    thread writes each rank's pieces over the gloo group `group`; after that every rank learns who
    wrote a file, and `finish(files)` runs on this thread (rank 0: marker and publication).
    `wait()` joins it and raises what it raised."""

    def __init__(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, group, rank: int,
                 world_size: int, stamp: Stamp, finish) -> None:
        import torch.distributed.checkpoint as dcp

        self.folder = Path(folder)
        self.error: BaseException | None = None
        flat, _, _ = _flat(model, optimizer)
        self._future = dcp.async_save(flat, storage_writer=_stamping_writer(self.folder, stamp), process_group=group)
        self._thread = threading.Thread(target=self._run, args=(group, rank, world_size, finish),
                                        name="optimizer-write", daemon=True)
        self._thread.start()

    def _run(self, group, rank: int, world_size: int, finish) -> None:
        try:
            self._future.result()
            flags = torch.zeros(world_size)
            flags[rank] = 1.0 if (self.folder / shard_file(rank)).exists() else 0.0
            dist.all_reduce(flags, group=group)
            finish([shard_file(r) for r, f in enumerate(flags.tolist()) if f])
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self.error = exc

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointError(f"writing the optimizer state to {self.folder} did not finish within {timeout:.0f} s")
        if self.error is not None:
            raise CheckpointError(f"writing the optimizer state to {self.folder} failed: "
                                  f"{type(self.error).__name__}: {self.error}") from None
