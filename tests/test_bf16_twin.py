"""The CPU twin of a GPU run's precision: the trainer computes and publishes in bfloat16, and the
learning rate is so small that one step moves a weight by far less than half a bf16 step. A
trainer that continued from the published (bf16) weights would round that progress away at every
load; it continues from the float32 state the checkpoint's shards hold instead, so a resident
trainer, a trainer started afresh every iteration and a resident trainer killed with kill -9 after
iteration 1 end with the same float32 model state and the same published weights."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from coordination.layout import RunLayout
from tests.e2e import check_complete_run, fresh_log, node_cmd
from tests.test_resident_trainer import FLAGS, _kill_trainers_left, _trainer_states, _wait, _weights
from train.optim_state import MASTER, SEP

pytestmark = pytest.mark.slow

TWIN = ("run.max_iterations=3", "train.dtype=bfloat16", "train.lr=1e-6", "inference.between_iterations=reload")


def _float32_state(folder: Path) -> dict[str, torch.Tensor]:
    """The trained parameters' float32 values in a checkpoint's optimizer shards, whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    src = folder / "optimizer"
    meta = HuggingFaceStorageReader(str(src)).read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=torch.float32) for k, m in meta.items() if k.endswith(SEP + MASTER)}
    dcp.load(out, storage_reader=HuggingFaceStorageReader(str(src)), no_dist=True)
    return out


def _run(procs, assets, log: Path, mode: str, kill_trainer_after: int | None = None) -> RunLayout:
    data, model = assets
    o = (*TWIN, f"train.resident={'false' if mode == 'per-iteration' else 'true'}")
    procs.start(f"n0-{mode}", node_cmd(data, model, log, *FLAGS, "--master", overrides=o))
    procs.start(f"n1-{mode}", node_cmd(data, model, log, *FLAGS, "--worker", "1", overrides=o))
    lay = RunLayout(log)
    if kill_trainer_after is not None:  # both nodes' trainers, once they released after that iteration
        _wait(lambda: all(any(s["state"] == "offloaded" and s.get("iteration") == kill_trainer_after
                              for s in _trainer_states(lay, r)) for r in (0, 1)), "both trainers offloaded", procs)
        for r in (0, 1):
            for s in _trainer_states(lay, r):
                os.kill(s["pid"], signal.SIGKILL)
    codes = procs.wait_all(900)
    assert set(codes.values()) == {0}, procs.log(f"n0-{mode}")[-3000:]
    check_complete_run(lay, 3, 24, 4, model)
    return lay


def test_resident_per_iteration_and_relaunched_trainers_keep_progress_below_bf16_resolution(procs, tmp_path, assets):
    runs = {}
    try:
        for mode, kill in (("resident", None), ("per-iteration", None), ("relaunched", 1)):
            runs[mode] = _run(procs, assets, fresh_log(tmp_path, mode), mode, kill)
    finally:
        time.sleep(1.5)  # trainers whose driver is gone check once a second
        for lay in runs.values():
            _kill_trainers_left({s["pid"] for r in (0, 1) for s in _trainer_states(lay, r)})
    start = _weights(assets[1])
    states = {mode: _float32_state(lay.checkpoint(3)) for mode, lay in runs.items()}
    ref = states["resident"]
    moved = sum(int((ref[k] != start[k.split(SEP)[0].removeprefix("lm.")]).sum()) for k in ref)
    assert moved > 0
    for mode in ("per-iteration", "relaunched"):
        assert set(states[mode]) == set(ref)
        worst = max(float((states[mode][k] - ref[k]).abs().max()) for k in ref)
        print(f"{mode}: float32 state differs from the resident run's by at most {worst:.3g}")
        assert worst == 0.0, f"{mode}: the float32 state differs from the resident run's by up to {worst}"
        published, resident = _weights(runs[mode].checkpoint(3)), _weights(runs["resident"].checkpoint(3))
        assert set(published) == set(resident)
        assert all(torch.equal(published[k], resident[k]) for k in resident)
