"""The RL trainer (`python -m train.trainer --plan`) with train.cp=2 on 2 torchrun processes
against the same plan's data trained by one process: phase 8 packs for one data rank in both,
so both make the same 4 AdamW steps and publish the same weights up to summation order.

Tolerance: the gradients agree within ~1e-6 of their scale (tests/test_context_parallel.py),
but AdamW divides each by its own running magnitude, so where a gradient entry is as small as
that noise its update (up to lr = 2e-4 per step) can change by a fraction of itself. 2e-5 is a
tenth of one step's update (measured 5.1e-6); the 4 steps move weights by up to 8e-4.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordination.layout import RunLayout
from coordination.records import read_record
from tests import train_support as ts

pytestmark = pytest.mark.slow
WEIGHT_TOL = 2e-5


def _train(root: Path, base: Path, **kw) -> RunLayout:
    layout = RunLayout(root)
    ts.write_trajectories(layout, 1, base)
    plan = ts.prepare(layout, 1, base, 0, **kw)
    if kw.get("world_size", 1) == 1:
        rc = ts.run_module("train.trainer", ["--plan", str(plan)], root / "train.log")
        assert rc == 0, (root / "train.log").read_text()
    else:
        codes = ts.torchrun("train.trainer", ["--plan", str(plan)], root / "logs", nnodes=1,
                            nproc_per_node=kw["world_size"])
        assert codes == [0], ts.logs_text(root / "logs")
    ts.publish(plan)
    return layout


def test_cp2_trainer_publishes_the_weights_one_process_trains_on_the_same_plan(tmp_path):
    base = ts.make_tiny(tmp_path / "tiny", layers=2)
    one = _train(tmp_path / "one", base)
    two = _train(tmp_path / "cp2", base, world_size=2, cp=2)
    w1, w2 = ts.load_weights(one.checkpoint(1)), ts.load_weights(two.checkpoint(1))
    assert w1.keys() == w2.keys()
    worst = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert worst <= WEIGHT_TOL, worst
    moved = max((w1[k] - ts.load_weights(base)[k]).abs().max().item() for k in w1)
    assert moved > 20 * WEIGHT_TOL
    results = [read_record(two.training_result(1, 1, r)).data for r in range(2)]
    single = read_record(one.training_result(1, 1, 0)).data
    # The step's tokens are counted once per CP group: the same as one process's.
    assert [s["completion_tokens"] for s in results[0]["steps"]] == [s["completion_tokens"] for s in single["steps"]]
    for a, b in zip(results[0]["steps"], single["steps"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
