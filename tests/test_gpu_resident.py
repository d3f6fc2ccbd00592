"""The gpu tier's end-to-end runs: one node, one GPU, the resident trainer of the ~200M model in
bfloat16 beside the transformers engine on the same device (scripts/test.sh --gpu; skipped
without CUDA).

What only the GPU shows about the resident trainer's contract (docs/design.md §9.6):
- the order "trainer released its device memory -> engine swaps" with CUDA's caching allocator:
  each iteration's "offloaded" precedes phase 12, a held offload delays phase 12 instead of
  overlapping it, and what the trainer still holds after its release is measured two ways: its own
  allocator (`device_memory_mb_after_release`, reserved bytes: tensors plus cache) and, from
  outside, the process's device memory as `nvidia-smi` lists it (the CUDA context and libraries
  that no `empty_cache` frees: the residue the engine must fit beside), against what the process
  holds while it trains (sampled during a held offload: weights, gradients and AdamW state, 16
  bytes per parameter at least);
- the optimizer state and the float32 model state written in the background (dcp.async_save from
  CUDA tensors) are complete and a trainer killed with kill -9 after iteration 1 continues from
  them: its run ends with the uninterrupted run's progress below bf16 resolution.

Tolerances: the same run on the same GPU is not bit-reproducible (attention backward kernels
accumulate in a varying order), so the relaunched run is compared with the uninterrupted one by
the size of what a lost float32 state would change. With lr 1e-6 a step moves a weight by ~1e-6
while half a bf16 step at |w| ~ 0.02 is ~4e-5: a trainer that continued from the published bf16
weights would be off by the distance of iteration 1's float32 state to the bf16 grid (mean over
the weights ~1e-5), while the kernels' noise changes an Adam update by a relative ~1e-3 of lr
(~1e-9). The mean difference must stay below a tenth of the loss it would be.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from coordination.layout import RunLayout
from tests.e2e import check_complete_run, fresh_log, node_cmd, rows
from tests.test_bf16_twin import _float32_state
from tests.test_resident_trainer import (HELD_OFFLOAD_S, _check_release_before_swap, _kill_trainers_left, _results,
                                         _trainer_states, _wait)

pytestmark = pytest.mark.gpu

ONE_NODE = ("--rl-phase", "both", "--eval-interval", "0", "--num-nodes", "1")
RUN = ("run.max_iterations=3", "train.dtype=bfloat16", "train.lr=1e-6", "train.resident=true",
       "inference.dtype=bfloat16", "inference.between_iterations=reload")
# What a trainer process may keep on the device after its release. nvidia-smi counts its CUDA
# context, kernels and library handles (1382 MiB measured on an H200 with torch 2.11, one rank),
# which no empty_cache frees; its allocator keeps only what stays allocated while idle (64.0 MiB
# measured: torch takes cuBLAS's workspaces from the caching allocator), never the training peak.
RESIDUE_LIMIT_MIB = 2048
ALLOCATOR_AFTER_RELEASE_LIMIT_MIB = 128


class DeviceSampler:
    """Samples, every 0.2 s, the state record of node 0's trainer and the device memory of each
    process as nvidia-smi lists it; `samples` holds (state, iteration, pid, used MiB or None) of
    the samples during which the state did not change."""

    def __init__(self, lay: RunLayout):
        self.lay, self.samples, self._stop = lay, [], threading.Event()
        self.smi = shutil.which("nvidia-smi")
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _apps(self) -> dict[int, float]:
        out = subprocess.run([self.smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        apps = {}
        for line in out.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
                apps[int(pid)] = float(mib)
        return apps

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            before = _trainer_states(self.lay, 0)
            if not before or self.smi is None:
                continue
            apps = self._apps()
            after = _trainer_states(self.lay, 0)
            # The trainer publishes a state before it takes device memory back: a sample counts
            # only when the same state record was there before and after nvidia-smi looked.
            if after and after[0]["time"] == before[0]["time"]:
                s = before[0]
                self.samples.append((s["state"], s.get("iteration"), s["pid"], apps.get(s["pid"])))

    def __enter__(self) -> "DeviceSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(15)


@pytest.fixture(scope="module")
def model_200m(tmp_path_factory) -> Path:
    from bench.load_publish import bench_model

    return bench_model(tmp_path_factory.mktemp("gpu-resident-m200") / "model")


def _run(procs, data: Path, model: Path, log: Path, name: str, *, env: dict | None = None,
         kill_trainer_after: int | None = None) -> RunLayout:
    procs.start(name, node_cmd(data, model, log, *ONE_NODE, "--master", overrides=RUN), **({"env": env} if env else {}))
    lay = RunLayout(log)
    if kill_trainer_after is not None:
        _wait(lambda: any(s["state"] == "offloaded" and s.get("iteration") == kill_trainer_after
                          for s in _trainer_states(lay, 0)), "the trainer offloaded", procs)
        for s in _trainer_states(lay, 0):
            os.kill(s["pid"], signal.SIGKILL)
    codes = procs.wait_all(900)
    assert set(codes.values()) == {0}, procs.log(name)[-3000:]
    check_complete_run(lay, 3, 24, 4, model)
    return lay


def _mean_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k] - b[k]).abs().sum()) for k in a) / sum(v.numel() for v in a.values())


def _bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16).to(torch.float32) for k, v in state.items()}


def test_one_gpu_resident_trainer_frees_the_device_before_the_swap_and_a_relaunch_keeps_its_float32_state(
        procs, tmp_path, assets, model_200m):
    from tests.procs import env
    from train.model_shape import ModelShape

    data = assets[0]
    runs = {}
    try:
        log = fresh_log(tmp_path, "held")
        lay = RunLayout(log)
        with DeviceSampler(lay) as sampler:
            runs["held"] = _run(procs, data, model_200m, log, "held",
                                env=env(BATON_TEST_HOLD_OFFLOAD=f"2:{HELD_OFFLOAD_S}"))
        runs["relaunched"] = _run(procs, data, model_200m, fresh_log(tmp_path, "relaunched"), "relaunched",
                                  kill_trainer_after=1)
    finally:
        time.sleep(1.5)  # trainers whose driver is gone check once a second
        for lay in runs.values():
            _kill_trainers_left({s["pid"] for s in _trainer_states(lay, 0)})

    results = _results(runs["held"], 3, world=1)
    peaks = [s["peak_memory_mb"] for it in (1, 2, 3) for s in results[it]["ranks"][0]["steps"]]
    after = [results[it]["ranks"][0]["device_memory_mb_after_release"] for it in (1, 2)]
    training = [mib for state, _, _, mib in sampler.samples if state == "training" and mib is not None]
    released = [mib for state, _, _, mib in sampler.samples if state == "offloaded" and mib is not None]
    print(f"trainer step peaks {min(peaks):.0f}-{max(peaks):.0f} MiB (allocator); after release the allocator "
          f"holds {after} MiB; nvidia-smi: {len(training)} samples while training, max "
          f"{max(training, default=float('nan')):.0f} MiB; {len(released)} samples after release, max "
          f"{max(released, default=float('nan')):.0f} MiB; {len(sampler.samples)} samples in all")
    _check_release_before_swap(runs["held"], iterations=2, nodes=1)
    assert all(a <= ALLOCATOR_AFTER_RELEASE_LIMIT_MIB for a in after), after
    assert released, ("nvidia-smi listed no device memory for the trainer process while it was offloaded "
                      f"(samples: {sampler.samples[:20]})")
    assert max(released) <= RESIDUE_LIMIT_MIB, released
    state_mib = 16 * ModelShape.from_model_dir(model_200m).params / 2**20
    assert training and max(training) - max(released) >= state_mib, (max(training, default=0), released, state_mib)

    final = {name: _float32_state(lay.checkpoint(3)) for name, lay in runs.items()}
    assert set(final["held"]) == set(final["relaunched"])
    first = _float32_state(runs["relaunched"].checkpoint(1))
    noise = _mean_distance(final["held"], final["relaunched"])
    lost = _mean_distance(first, _bf16(first))
    same_rollouts = all(rows(runs["held"], it)["completion_ids"].to_pylist()
                        == rows(runs["relaunched"], it)["completion_ids"].to_pylist() for it in (1, 2, 3))
    print(f"mean |float32 state of the relaunched run - uninterrupted run| after iteration 3: {noise:.3g}; "
          f"a reload from bf16 after iteration 1 would lose {lost:.3g} on average; same rollouts: {same_rollouts}")
    assert same_rollouts, "the two runs sampled different tokens: their float32 states are not comparable"
    assert lost > 0
    assert noise < 0.1 * lost, (noise, lost)
