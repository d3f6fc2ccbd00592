"""Measuring memory on CPU, where torch keeps no peak counter.

CUDA has `torch.cuda.max_memory_allocated`; the CPU allocator has nothing alike, and tracemalloc
does not see it. Two honest measures instead:

- `peak_tensor_bytes(fn)`: with `profile_memory=True` the PyTorch profiler receives an event for
  every allocation and free of the CPU allocator. The running sum of those events over `fn` is
  the tensor memory `fn` holds at each moment beyond what was live before it started, and its
  maximum is the peak that activation checkpointing, offloading or a chunked LM head lower. The
  profiler slows `fn` down: use it to measure memory, never time.
- `rss_mb()` / `peak_rss_mb()`: the process's resident set now and at its high-water mark, what
  the operating system must provide (tensors, allocator caches, libraries). The benchmarks run each
  configuration in a fresh process, so the high-water marks of different runs do not mix.
"""
from __future__ import annotations

import os
import resource
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_tensor_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """(fn(), the highest number of bytes allocated during fn() beyond those live at its start)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - base

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


def rss_mb(pid: int | None = None) -> float:
    """Resident set size now, in MiB, of this process or of process `pid`."""
    with open(f"/proc/{pid or 'self'}/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb(pid: int | None = None) -> float:
    """The resident-set high-water mark since it started, in MiB (Linux reports KiB), of this
    process or of process `pid`."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
