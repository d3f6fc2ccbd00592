"""Which phases run in which iteration (docs/design.md §6): the named conditions of the run plan
that the driver and the dry run both ask (rl/plan.py RUNS_WHEN)."""
from __future__ import annotations

from pathlib import Path

import pytest

from coordination.config import load
from rl.jobs import KINDS, kind_for
from rl.plan import job_plan
from rl.args import RunArgs
from rl.runconfig import RunConfig


def running(rl_phase: str, split: str | None, iteration: int) -> list[int]:
    cfg = load(RunConfig, [], ["model.path=/m", "run.max_iterations=2", "run.eval_interval=2"])
    plan = job_plan(RunArgs(Path("/d"), Path("/l"), kind_for(rl_phase, split, bench=False), 2, 1, [1.0], 0), cfg)
    return [n for n in range(14) if plan.runs(n, iteration)]


@pytest.mark.parametrize("rl_phase,split,iteration,phases", [
    ("both", None, 1, list(range(14))),                      # an eval iteration: everything
    ("both", None, 2, [0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13]),  # no eval (5, 6)
    ("both", None, 3, [0, 5, 6, 13]),                        # the final evaluation-only iteration
    ("rollout", "train-only", 2, [0, 1, 2, 3, 4]),
    ("update", None, 2, [7, 8, 9, 10, 11, 12, 13]),
    ("rollout", "eval-only", 2, [0]),
    ("rollout", "eval-only", 3, [0, 5, 6]),
])
def test_each_job_runs_the_phases_its_conditions_allow(rl_phase, split, iteration, phases):
    assert running(rl_phase, split, iteration) == phases


def test_the_flags_of_each_job_kind_select_it_and_are_what_job_json_has_always_recorded():
    # job.json compares these facts at every join, so a run folder made before stays joinable.
    recorded = {"both": ("both", None), "rollout": ("rollout", "train-only"), "update": ("update", None),
                "eval": ("rollout", "eval-only"), "bench": ("bench", None)}
    assert {k.name: (k.rl_phase, k.rollout_split) for k in KINDS.values()} == recorded
    for kind in KINDS.values():
        assert kind_for(kind.rl_phase, kind.rollout_split, bench=kind.benchmarks) is kind
    with pytest.raises(ValueError, match=r"--rl-phase must be one of rollout\|update\|both \(got 'bench'\)"):
        kind_for("bench", None, bench=False)  # the benchmark's recorded name is no --rl-phase value
