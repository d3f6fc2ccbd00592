"""The trainer as one plain process (`python -m train.trainer`): training, publication, resume."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests import train_support as ts
from coordination.layout import RunLayout
from coordination.records import read_record
from coordination.checkpoints import is_complete, read_latest
from train.results import read_results


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ts.make_tiny(tmp_path_factory.mktemp("base") / "tiny", layers=2)


@pytest.fixture(scope="module")
def first_iteration(base, tmp_path_factory):
    """Iteration 1 trained once in a run directory (shared by the tests that read it)."""
    root = tmp_path_factory.mktemp("run")
    layout = RunLayout(root)
    ts.write_trajectories(layout, 1, base)
    plan = ts.prepare(layout, 1, base, 0)
    rc = ts.run_module("train.trainer", ["--plan", str(plan)], root / "iter1.log")
    if rc == 0:
        ts.publish(plan)
    return layout, plan, rc


def _log(layout: RunLayout, name: str) -> str:
    return (layout.root / name).read_text()


def test_training_publishes_a_checkpoint_that_transformers_loads_with_changed_parameters(base, first_iteration):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    layout, _, rc = first_iteration
    assert rc == 0, _log(layout, "iter1.log")
    assert read_latest(layout) == (1, layout.checkpoint(1))
    folder = layout.checkpoint(1)
    assert is_complete(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert AutoTokenizer.from_pretrained(str(folder)).eos_token_id == 2
    before, after = ts.load_weights(base), model.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert len(changed) == len(before)
    state = read_record(folder / "trainer_state.json").data
    assert state["optimizer_step"] == 4 and state["has_optimizer_state"] and state["world_size"] == 1
    result = read_record(layout.training_result(1, 1, 0), kind="training-result").data
    assert result["ok"] and len(result["steps"]) == 4
    for step in result["steps"]:
        assert step["completion_tokens"] > 0 and step["grad_norm"] > 0 and step["tokens_per_s"] > 0
        assert step["peak_memory_mb"] > 0 and 0 <= step["clip_fraction"] <= 1
    assert result["summary"]["steps"] == 4
    assert read_results(layout, 1, 1, 1) == {"ok": True, "missing": [], "errors": {}, "summary": result["summary"]}
    assert _log(layout, "iter1.log").count("optimizer step") >= 4   # one line per step


def test_the_kl_reference_is_the_base_model_and_pulls_the_update_towards_it(base, first_iteration, tmp_path):
    """train.kl_coef > 0: the reference (the base, loaded sharded like the policy) equals the
    policy before the first step, so that step's KL is 0 up to float32 rounding of identical
    arithmetic; later steps see a KL above 0, and the update differs from the run without it."""
    layout = RunLayout(tmp_path)
    ts.write_trajectories(layout, 1, base)
    plan = ts.prepare(layout, 1, base, 0, reference_model=base, kl_coef=0.5)
    rc = ts.run_module("train.trainer", ["--plan", str(plan)], tmp_path / "iter1.log")
    assert rc == 0, (tmp_path / "iter1.log").read_text()
    ts.publish(plan)
    steps = read_record(layout.training_result(1, 1, 0), kind="training-result").data["steps"]
    assert len(steps) == 4
    assert abs(steps[0]["kl"]) <= 1e-6 and all(s["kl"] > 1e-6 for s in steps[1:]), [s["kl"] for s in steps]
    plain_layout, _, plain_rc = first_iteration
    assert plain_rc == 0
    with_kl, without = ts.load_weights(layout.checkpoint(1)), ts.load_weights(plain_layout.checkpoint(1))
    assert any(not torch.equal(v, without[k]) for k, v in with_kl.items())


def test_rerun_of_a_published_iteration_exits_zero_without_training(first_iteration):
    layout, plan, _ = first_iteration
    weights = layout.checkpoint(1) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ts.run_module("train.trainer", ["--plan", str(plan), "--attempt", "2"], layout.root / "rerun.log") == 0
    assert "already published" in _log(layout, "rerun.log")
    assert weights.stat().st_mtime_ns == before
    assert not layout.training_result(1, 2, 0).exists()


def test_next_iteration_resumes_the_optimizer_and_its_step_count(first_iteration):
    layout, _, _ = first_iteration
    ts.write_trajectories(layout, 2, layout.checkpoint(1), seed=1, policy_iteration=1)
    plan = ts.prepare(layout, 2, layout.checkpoint(1), 1)
    assert ts.run_module("train.trainer", ["--plan", str(plan)], layout.root / "iter2.log") == 0, \
        _log(layout, "iter2.log")
    ts.publish(plan)
    assert "optimizer step 4): the trained parameters continue from their float32 state" in _log(layout, "iter2.log")
    state = read_record(layout.checkpoint(2) / "trainer_state.json").data
    assert state["optimizer_step"] == 8
    assert ts.optimizer_steps(layout.checkpoint(2)) == {8.0}
    assert read_latest(layout)[0] == 2


def test_a_rerun_on_the_same_inputs_gives_identical_weights(base, first_iteration, tmp_path):
    layout, _, _ = first_iteration
    other = RunLayout(tmp_path / "again")
    shutil.copytree(layout.rollout_iter_dir("train", 1), other.rollout_iter_dir("train", 1))
    plan = ts.prepare(other, 1, base, 0)
    assert ts.run_module("train.trainer", ["--plan", str(plan)], tmp_path / "again.log") == 0
    ts.publish(plan)
    a, b = ts.load_weights(layout.checkpoint(1)), ts.load_weights(other.checkpoint(1))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_plan_without_steps_republishes_the_input_weights_unchanged(base, tmp_path):
    layout = RunLayout(tmp_path)
    ts.write_trajectories(layout, 1, base, tasks=3, all_same_reward=True)
    plan = ts.prepare(layout, 1, base, 0)
    assert ts.run_module("train.trainer", ["--plan", str(plan)], tmp_path / "zero.log") == 0, \
        (tmp_path / "zero.log").read_text()
    ts.publish(plan)
    a, b = ts.load_weights(base), ts.load_weights(layout.checkpoint(1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_latest(layout)[0] == 1
    assert read_record(layout.checkpoint(1) / "trainer_state.json").data["optimizer_step"] == 0


def test_launching_another_world_size_than_planned_fails_at_once(base, tmp_path):
    layout = RunLayout(tmp_path)
    ts.write_trajectories(layout, 1, base, tasks=2)
    plan = ts.prepare(layout, 1, base, 0, world_size=2)
    rc = ts.run_module("train.trainer", ["--plan", str(plan)], tmp_path / "ws.log", timeout=60)
    assert rc == 2
    assert "made for 2 trainer processes but 1 were launched" in (tmp_path / "ws.log").read_text()
    assert read_latest(layout) is None
