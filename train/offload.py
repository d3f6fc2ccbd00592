"""Moving training state to host memory: saved activations (during a step) and optimizer state
(between steps).

Activation offloading is a pair of saved-tensor hooks around the forward pass: every tensor
autograd saves for backward (except parameters and tiny tensors) is copied to host memory when
it is saved and copied back when backward unpacks it. With activation checkpointing on, what
autograd still saves are the checkpointed blocks' inputs, so the two compose: checkpointing
shrinks each block to its input, offloading moves those inputs off the accelerator.
On CUDA the copies to pinned host memory run on a side stream; at most
`max_inflight_activations` copies are in flight: the device tensor of a copy is released only
once the copy has finished, so a larger bound overlaps more copying with compute and holds more
device memory. On CPU, "host memory" is the memory the tensor is already in: the hooks still copy
(the same code path, which the CPU tests exercise) but save nothing.

Optimizer-state offloading keeps AdamW's moments in host memory between steps: an optimizer
step pre-hook brings them to the parameters' device, a post-hook copies them back to host
memory. Checkpoints save them from wherever they are.
"""
from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

MIN_OFFLOAD_BYTES = 1024   # tiny saved tensors (scalars, shapes) are not worth a copy


class ActivationOffload:
    """A context manager for the forward pass; counts what it moved (for tests and logs)."""

    def __init__(self, max_inflight: int, device: torch.device):
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1 (got {max_inflight})")
        self.max_inflight = max_inflight
        self.device = device
        self.tensors = 0
        self.bytes = 0
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._inflight: collections.deque = collections.deque()
        self._hooks: Any = None

    # -- saved-tensor hooks ---------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if isinstance(t, nn.Parameter) or nbytes < MIN_OFFLOAD_BYTES or t.layout != torch.strided:
            return t
        if t.device.type != "cuda" and self._stream is not None:
            return t   # a GPU trainer's tensor that is in host memory already
        self.tensors += 1
        self.bytes += nbytes
        if self._stream is None:   # CPU trainer: the same bookkeeping, a copy within the same memory
            return _Offloaded(t.detach().to("cpu", copy=True), t.device, None, None)
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        entry = _Offloaded(host, t.device, t, done)
        self._inflight.append(entry)
        while len(self._inflight) > self.max_inflight:
            self._inflight.popleft().release()
        return entry

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.restore()

    def __enter__(self) -> "ActivationOffload":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
        while self._inflight:   # the forward is over: let go of every device copy once its copy is done
            self._inflight.popleft().release()


class _Offloaded:
    """A saved tensor in host memory, and (on CUDA, while its copy runs) the device original."""

    __slots__ = ("host", "device", "original", "done")

    def __init__(self, host: torch.Tensor, device: torch.device, original: torch.Tensor | None,
                 done: Any):
        self.host, self.device, self.original, self.done = host, device, original, done

    def release(self) -> None:
        if self.original is not None:
            self.done.synchronize()
            self.original = None

    def restore(self) -> torch.Tensor:
        if self.original is not None:   # still on the device: no copy needed
            original, self.original = self.original, None
            return original
        return self.host.to(self.device, non_blocking=self.device.type == "cuda", copy=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _swap_local(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`value` with its (local) data replaced by `local`: a DTensor keeps its mesh and placements."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        # The constructor FSDP2 uses for its CPU-offloaded shards: `from_local` would move the local
        # tensor back to the mesh's device.
        return DTensor(local, value._spec, requires_grad=False)
    return local


class OptimizerStateOffload:
    """Keeps the tensor states of `optimizer` in host memory between steps (hooks on step())."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = device
        self.moves = 0
        self._handles = [optimizer.register_step_pre_hook(lambda *_: self.to_device()),
                         optimizer.register_step_post_hook(lambda *_: self.to_host())]

    def _move(self, device: torch.device, pin: bool) -> None:
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # Scalar states (Adam's step) stay where the optimizer keeps them.
                if not isinstance(value, torch.Tensor) or value.ndim == 0:
                    continue
                local = _local(value)
                if pin and device.type == "cpu" and self.device.type == "cuda":
                    moved = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=True)
                    moved.copy_(local)
                else:
                    moved = local.to(device, copy=True)
                state[key] = _swap_local(value, moved)
                self.moves += 1

    def to_device(self) -> None:
        self._move(self.device, pin=False)

    def to_host(self) -> None:
        self._move(torch.device("cpu"), pin=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class ResidentOffload:
    """Between iterations of a resident trainer whose engine shares its devices: every storage of
    the models' parameters, any gradients and the optimizer state is copied to host memory (pinned
    on CUDA) and its device storage freed (resized to 0 bytes), then restored in place before the
    next step. Storages, not parameters, are moved, so every Parameter object, FSDP2's sharded
    views and the optimizer's references stay what they were. On CPU the same copies and frees run
    (host and device are one memory there); `moved_bytes` and `storages` are the bookkeeping."""

    def __init__(self, modules: list[nn.Module], optimizer: torch.optim.Optimizer, device: torch.device):
        self.modules = [m for m in modules if m is not None]
        self.optimizer = optimizer
        self.device = device
        self.on_host = False
        self.moved_bytes = 0
        self.storages = 0
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def to_host(self) -> None:
        if self.on_host:
            return
        pin = self.device.type == "cuda"
        self._saved, self.moved_bytes = [], 0
        for storage in _storages(self.modules, self.optimizer, self.device):
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_bytes_of(storage))   # blocking: the bytes are on the host when it returns
            self.moved_bytes += storage.nbytes()
            # Freed one by one: on CPU host and device are one memory, and freeing only after the
            # last copy would hold the whole state twice for a moment.
            storage.resize_(0)
            self._saved.append((storage, host))
        if pin:
            torch.cuda.empty_cache()
        self.storages = len(self._saved)
        self.on_host = True

    def to_device(self) -> None:
        if not self.on_host:
            return
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._saved = []
        self.on_host = False

    def discard(self) -> int:
        """Let go of the host copies (pinned on CUDA) without restoring them: the model they belong
        to is being torn down (free_storages), so nothing will read them again. Returns their bytes."""
        dropped = sum(host.numel() for _, host in self._saved)
        self._saved = []
        self.on_host = False
        return dropped


def _storages(modules: list[nn.Module | None], optimizer: torch.optim.Optimizer, device: torch.device):
    """Each distinct non-empty storage on `device` of the modules' parameters, gradients and buffers
    and of the optimizer's tensor states (scalar states, such as Adam's step, stay where they are)."""
    tensors = []
    for m in modules:
        if m is None:
            continue
        for p in m.parameters():
            tensors += [p] if p.grad is None else [p, p.grad]
        tensors += list(m.buffers())
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
    seen: set[int] = set()
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen or storage.device.type != device.type:
            continue
        seen.add(storage.data_ptr())
        yield storage


def free_storages(modules: list[nn.Module | None], optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Free, for good, every storage on `device` of the modules and the optimizer (resized to 0 bytes)
    and drop the optimizer's state; returns the bytes freed. The memory comes back at once, whoever
    still refers to the tensors: FSDP2's reference cycles, a closure, a traceback frame. Storages in
    host memory on a CUDA trainer (optimizer-state offload) are freed by dropping the state."""
    freed = 0
    for storage in list(_storages(modules, optimizer, device)):
        freed += storage.nbytes()
        storage.resize_(0)
    optimizer.state.clear()
    return freed


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


def device_memory_mb(device: torch.device) -> float:
    """Device memory this process's caching allocator holds on `device` (MiB): its tensors and its
    cache (reserved), which no other process (the engine) can use until it is emptied. 0 on CPU,
    which has no such count."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / 2**20
    return 0.0
