"""Real multi-process training: two `torchrun --nnodes 2` invocations on this host (gloo, CPU).

The failure test is one short launch and runs in the default tier; the others launch torchrun
two or three times each and are marked slow."""
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
def trajectories(base, tmp_path_factory) -> Path:
    """Iteration 1's all.parquet, written once and copied into every run directory."""
    layout = RunLayout(tmp_path_factory.mktemp("template"))
    ts.write_trajectories(layout, 1, base, tasks=8, samples=4)
    return layout.rollout_iter_dir("train", 1)


def _run_dir(path: Path, trajectories: Path) -> RunLayout:
    layout = RunLayout(path)
    shutil.copytree(trajectories, layout.rollout_iter_dir("train", 1))
    return layout


@pytest.fixture(scope="module")
def two_node_run(base, trajectories, tmp_path_factory):
    """Iteration 1 trained by 2 nodes x 1 process with FSDP2."""
    layout = _run_dir(tmp_path_factory.mktemp("two-node"), trajectories)
    plan = ts.prepare(layout, 1, base, 0, world_size=2)
    codes = ts.torchrun("train.trainer", ["--plan", str(plan)], layout.root / "logs-1")
    if codes == [0, 0]:
        ts.publish(plan)
    return layout, codes


def _results(layout: RunLayout, iteration: int, attempt: int, world: int) -> list[dict]:
    return [read_record(layout.training_result(iteration, attempt, r)).data for r in range(world)]


@pytest.mark.slow
def test_two_nodes_train_publish_a_loadable_checkpoint_and_the_next_iteration_resumes(base, two_node_run):
    from transformers import AutoModelForCausalLM

    layout, codes = two_node_run
    assert codes == [0, 0], ts.logs_text(layout.root / "logs-1")
    folder = layout.checkpoint(1)
    assert read_latest(layout) == (1, folder) and is_complete(folder)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    before = ts.load_weights(base)
    assert all(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert ts.optimizer_files(folder) == ts.DCP_SHARDS_2
    assert read_record(folder / "trainer_state.json").data["optimizer_step"] == 4
    r0, r1 = _results(layout, 1, 1, 2)
    assert [s["loss"] for s in r0["steps"]] == [s["loss"] for s in r1["steps"]]   # global metrics agree

    # Iteration 2 on two nodes continues Adam from iteration 1 (same world size).
    ts.write_trajectories(layout, 2, folder, seed=1, policy_iteration=1)
    plan2 = ts.prepare(layout, 2, folder, 1, world_size=2)
    assert ts.torchrun("train.trainer", ["--plan", str(plan2)], layout.root / "logs-2") == [0, 0], \
        ts.logs_text(layout.root / "logs-2")
    ts.publish(plan2)
    assert read_record(layout.checkpoint(2) / "trainer_state.json").data["optimizer_step"] == 8
    assert "optimizer step 4)" in ts.logs_text(layout.root / "logs-2")
    assert ts.optimizer_steps(layout.checkpoint(2)) == {8.0}

    # Iteration 3 in one process: the 2-rank optimizer state is resharded into one.
    ts.write_trajectories(layout, 3, layout.checkpoint(2), seed=2, policy_iteration=2)
    plan3 = ts.prepare(layout, 3, layout.checkpoint(2), 2, world_size=1)
    assert ts.run_module("train.trainer", ["--plan", str(plan3)], layout.root / "iter3.log") == 0, \
        (layout.root / "iter3.log").read_text()
    ts.publish(plan3)
    assert read_record(layout.checkpoint(3) / "trainer_state.json").data["optimizer_step"] == 12
    assert read_latest(layout)[0] == 3


def _fail_rank_one(layout: RunLayout, base: Path, logs: Path) -> tuple[Path, list[int]]:
    """A real failure: whichever process becomes rank 1 finds its data share corrupt."""
    plan = ts.prepare(layout, 1, base, 0, world_size=2)
    layout.training_shard(1, 1).write_bytes(b"PAR1 this is not the planned shard")
    return plan, ts.torchrun("train.trainer", ["--plan", str(plan)], logs)


def test_a_failing_rank_makes_both_nodes_exit_non_zero_and_nothing_is_published(base, trajectories, tmp_path):
    layout = _run_dir(tmp_path / "run", trajectories)
    _, codes = _fail_rank_one(layout, base, tmp_path / "logs-fail")
    text = ts.logs_text(tmp_path / "logs-fail")
    assert len(codes) == 2 and all(c != 0 for c in codes), text
    assert "altered or is corrupt" in text and "failed on trainer rank(s) [1]" in text
    assert not layout.checkpoint(1).exists() and read_latest(layout) is None
    assert not layout.checkpoint_staging(1, 1).joinpath("baton-complete.json").exists()
    outcome = read_results(layout, 1, 1, 2)
    assert not outcome["ok"] and outcome["missing"] == [] and sorted(outcome["errors"]) == [0, 1]
    assert "ShardError" in outcome["errors"][1] and "PeerFailed" in outcome["errors"][0]


@pytest.mark.slow
def test_a_retry_after_a_failure_starts_from_the_same_inputs_and_gives_the_clean_weights(base, trajectories,
                                                                                         two_node_run, tmp_path):
    layout = _run_dir(tmp_path / "run", trajectories)
    plan, codes = _fail_rank_one(layout, base, tmp_path / "logs-fail")
    assert all(c != 0 for c in codes)
    ts.prepare(layout, 1, base, 0, world_size=2)     # phase 8 again: the damaged shard is rebuilt identically
    assert ts.torchrun("train.trainer", ["--plan", str(plan), "--attempt", "2"], tmp_path / "logs-retry") == [0, 0], \
        ts.logs_text(tmp_path / "logs-retry")
    ts.publish(plan, attempt=2)
    clean, _ = two_node_run
    a, b = ts.load_weights(clean.checkpoint(1)), ts.load_weights(layout.checkpoint(1))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ddp_and_fsdp2_on_two_processes_and_one_process_make_the_same_update(base, trajectories, tmp_path):
    runs = {}
    for name, backend, world in (("fsdp2", "fsdp", 2), ("ddp2", "ddp", 2), ("fsdp1", "fsdp", 1)):
        layout = _run_dir(tmp_path / name, trajectories)
        plan = ts.prepare(layout, 1, base, 0, world_size=world, backend=backend)
        if world == 1:
            codes = [ts.run_module("train.trainer", ["--plan", str(plan)], tmp_path / f"{name}.log")]
        else:
            codes = ts.torchrun("train.trainer", ["--plan", str(plan)], tmp_path / f"logs-{name}", nnodes=1,
                                nproc_per_node=2)
        assert set(codes) == {0}, ts.logs_text(tmp_path / f"logs-{name}") if world > 1 else ""
        runs[name] = (layout, world)
    losses = {n: [s["loss"] for s in _results(lay, 1, 1, w)[0]["steps"]] for n, (lay, w) in runs.items()}
    assert losses["fsdp2"] == pytest.approx(losses["ddp2"], abs=1e-6)
    assert losses["fsdp2"] == pytest.approx(losses["fsdp1"], abs=1e-6)
    weights = {n: ts.load_weights(lay.checkpoint(1)) for n, (lay, _) in runs.items()}
    for k, v in weights["fsdp2"].items():
        assert torch.allclose(v, weights["ddp2"][k], atol=1e-6), k
        assert torch.allclose(v, weights["fsdp1"][k], atol=1e-6), k
