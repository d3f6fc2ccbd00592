"""End-to-end runs of scripts/run.sh with real processes, the tiny model and real torchrun (issue 5)."""
from __future__ import annotations

import re

import pyarrow.compute as pc
import pytest

from coordination.layout import RunLayout
from coordination.records import read_record
from tests.e2e import check_complete_run as _check_complete_run
from tests.e2e import checkpoints_load as _checkpoints_load
from tests.e2e import fresh_log, node_cmd
from tests.e2e import kill_and_restart as _kill_and_restart
from tests.e2e import max_logprob_gap as _max_logprob_gap
from tests.e2e import rows as _rows
from tests.procs import wait_for_text


def _metrics(lay: RunLayout, it: int) -> dict:
    return read_record(lay.metrics(it)).data


def test_one_node_runs_two_iterations_with_eval_and_publishes_checkpoints(procs, tmp_path, assets):
    data, model = assets
    log = fresh_log(tmp_path)
    procs.start("n0", node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "1",
                               overrides=("run.max_iterations=2",)))
    assert procs.wait_all(400) == {"n0": 0}, procs.log("n0")[-3000:]
    lay = RunLayout(log)
    _checkpoints_load(lay, [1, 2], model)
    assert read_record(lay.latest).data["iteration"] == 2
    for it in (1, 2):
        m = _metrics(lay, it)
        assert m["eval_accuracy"] is not None and m["train_reward_mean"] is not None
        assert m["loss"] is not None and m["steps"] == 2, m
        assert _rows(lay, it).num_rows == 24 * 4
    final = _metrics(lay, 3)  # the final evaluation measures checkpoint 2
    assert final["eval_accuracy"] is not None and "loss" not in final
    console = procs.log("n0")
    assert "finished" in console
    for it in (1, 2):   # one line per finished iteration on the node's console
        assert re.search(rf"iteration {it} done in [0-9.]+ s: train reward [0-9.]+, eval accuracy [0-9.]+ "
                         rf"\(checkpoint {it - 1}\), loss", console), console[-3000:]
    assert re.search(r"iteration 3 done in [0-9.]+ s: eval accuracy [0-9.]+ \(checkpoint 2\)", console)


def test_lora_run_publishes_adapters_only_and_samples_the_next_iteration_from_them(procs, tmp_path, assets):
    from coordination.checkpoints import is_complete, serving_weights

    data, model = assets
    log = fresh_log(tmp_path)
    # A LoRA-sized learning rate, so that two steps move the adapters far from the base (~0.6 nats).
    lora = ("run.max_iterations=2", "train.lora.rank=4", "train.lora.publish=adapters", "train.lr=0.01")
    procs.start("n0", node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "1", overrides=lora))
    assert procs.wait_all(400) == {"n0": 0}, procs.log("n0")[-3000:]
    lay = RunLayout(log)
    for it in (1, 2):
        folder = lay.checkpoint(it)
        assert is_complete(folder) and (folder / "adapter" / "adapter_model.safetensors").is_file()
        assert not (folder / "config.json").exists() and not list(folder.glob("*.safetensors")), "not adapters-only"
        weights, adapter = serving_weights(folder)
        assert (weights.resolve(), adapter) == (model.resolve(), folder / "adapter")
    train2 = _rows(lay, 2)
    assert set(train2["policy_iteration"].to_pylist()) == {1} and train2.num_rows == 24 * 4
    # Iteration 2 sampled from the base with adapter 1, which the base alone does not reproduce.
    assert _max_logprob_gap(train2, model, lay.checkpoint(1) / "adapter", 1.0) < 1e-4
    assert _max_logprob_gap(train2, model, None, 1.0) > 1e-2
    final = _rows(lay, 3, "eval")                   # the final evaluation: greedy, base with adapter 2
    assert set(final["policy_iteration"].to_pylist()) == {2}
    assert _max_logprob_gap(final, model, lay.checkpoint(2) / "adapter", 0.0) < 1e-4
    assert _metrics(lay, 3)["eval_accuracy"] is not None
    assert "finished" in procs.log("n0")


@pytest.mark.slow
def test_two_nodes_split_rollouts_by_weight_and_train_as_one_torchrun(procs, tmp_path, assets):
    data, model = assets
    log = fresh_log(tmp_path)
    flags = ("--rl-phase", "both", "--eval-interval", "1", "--num-nodes", "2", "--rank-weights", "2,1")
    procs.start("n0", node_cmd(data, model, log, *flags, "--master", overrides=("run.max_iterations=2",)))
    procs.start("n1", node_cmd(data, model, log, *flags, "--worker", "1", overrides=("run.max_iterations=2",)))
    assert procs.wait_all(600) == {"n0": 0, "n1": 0}, procs.log("n1")[-3000:]
    lay = RunLayout(log)
    for it in (1, 2):
        t = _rows(lay, it)
        per_rank = {r: len(set(t.filter(pc.equal(t["rank"], r))["task_id"].to_pylist())) for r in (0, 1)}
        assert per_rank == {0: 16, 1: 8}, per_rank
        results = sorted(p.name for p in (lay.training_dir(it) / "attempt-1").glob("result-rank-*.json"))
        assert results == ["result-rank-0.json", "result-rank-1.json"], "training was not a 2-process torchrun"
        ev = read_record(lay.rollout_stats("eval", it)).data
        assert ev["per_rank"]["0"]["tasks"] == 11 and ev["per_rank"]["1"]["tasks"] == 5
    _checkpoints_load(lay, [1, 2], model)
    for r in (0, 1):
        assert "torch.distributed.run" in (lay.job("both").log_file(r, "trainer")).read_text()


@pytest.mark.slow
def test_pipelined_rollout_and_update_jobs_keep_the_staleness_bound(procs, tmp_path, assets):
    data, model = assets
    log = fresh_log(tmp_path)
    over = ("run.max_iterations=3", "run.max_staleness=1")
    procs.start("roll", node_cmd(data, model, log, "--rl-phase", "rollout", "--rollout-split", "train-only",
                                 overrides=over))
    procs.start("upd", node_cmd(data, model, log, "--rl-phase", "update", overrides=over))
    assert procs.wait_all(600) == {"roll": 0, "upd": 0}, procs.log("upd")[-3000:]
    lay = RunLayout(log)
    for it in (1, 2, 3):
        pol = set(_rows(lay, it)["policy_iteration"].to_pylist())
        assert len(pol) == 1 and min(pol) >= it - 1 - 1, (it, pol)
    _checkpoints_load(lay, [1, 2, 3], model)


@pytest.mark.slow
@pytest.mark.parametrize("phase", [1, 10])
def test_worker_killed_mid_phase_rejoins_with_the_same_command(procs, tmp_path, assets, phase):
    data, model = assets
    log = fresh_log(tmp_path)
    lay = RunLayout(log)
    over = ("run.max_iterations=2", "tasks.tasks_per_iteration=160", "rollout.prompts_per_call=2",
            "rollout.chunk_groups=2")
    flags = ("--rl-phase", "both", "--eval-interval", "0", "--num-nodes", "2", "--rank-weights", "1,1")
    w_cmd = node_cmd(data, model, log, *flags, "--worker", "1", overrides=over)
    procs.start("n0", node_cmd(data, model, log, *flags, "--master", overrides=over))
    procs.start("n1", w_cmd)
    if phase == 1:
        chunks = lay.rollout_rank_dir("train", 1, 1)
        when = lambda: chunks.exists() and any(p.suffix == ".parquet" for p in chunks.iterdir())  # noqa: E731
    else:  # once the trainers have met and started training: the master's attempt must fail
        trainer_log = lay.job("both").log_file(1, "trainer")
        when = lambda: trainer_log.exists() and "rank 1/2 on" in trainer_log.read_text()  # noqa: E731
    _kill_and_restart(procs, "n1", w_cmd, when)
    codes = procs.wait_all(900)
    assert codes["n0"] == 0 and codes["n1-again"] == 0, procs.log("n1-again")[-3000:] + procs.log("n0")[-3000:]
    _check_complete_run(lay, 2, 160, 4, model)
    assert lay.job("both").claim(1, 2).exists()
    if phase == 1:
        done = read_record(lay.rollout_done("train", 1, 1)).data
        assert any(c["name"].endswith("-g1.parquet") for c in done["chunks"]), "the restarted rank redid everything"
    else:
        assert (lay.training_dir(1) / "attempt-2").exists(), "the interrupted training attempt was not retried"
        assert "asked for attempt 2" in procs.log("n0")


@pytest.mark.slow
def test_master_killed_in_aggregation_resumes_and_the_run_completes(procs, tmp_path, assets):
    data, model = assets
    log = fresh_log(tmp_path)
    lay = RunLayout(log)
    over = ("run.max_iterations=2",)
    flags = ("--rl-phase", "both", "--eval-interval", "0", "--num-nodes", "2", "--rank-weights", "1,1")
    m_cmd = node_cmd(data, model, log, *flags, "--master", overrides=over)
    from tests.procs import env
    procs.start("n0", m_cmd, env=env(BATON_HOLD_PHASE="3:30"))
    procs.start("n1", node_cmd(data, model, log, *flags, "--worker", "1", overrides=over))
    wait_for_text(procs, "n0", "holding phase 3", 300)
    _kill_and_restart(procs, "n0", m_cmd, lambda: True)
    codes = procs.wait_all(900)
    assert codes["n0-again"] == 0 and codes["n1"] == 0, procs.log("n0-again")[-3000:]
    _check_complete_run(lay, 2, 24, 4, model)
    assert lay.job("both").claim(0, 2).exists()


@pytest.mark.vllm
def test_one_node_run_with_the_vllm_engine_on_cpu(procs, tmp_path, assets):
    import os

    python = os.environ.get("BATON_VLLM_PYTHON")
    if not python:
        pytest.fail("the vllm tier needs BATON_VLLM_PYTHON (scripts/test.sh --all sets it to .venv-vllm/bin/python)")
    data, model = assets
    log = fresh_log(tmp_path)
    over = ("run.max_iterations=2", "inference.engine=vllm", "inference.vllm.cpu=true",
            f"inference.vllm.python={python}", "inference.between_iterations=restart")
    procs.start("n0", node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "1", overrides=over))
    assert procs.wait_all(1200) == {"n0": 0}, procs.log("n0")[-4000:]
    lay = RunLayout(log)
    _checkpoints_load(lay, [1, 2], model)
    for it in (1, 2):
        assert _rows(lay, it).num_rows == 24 * 4
        assert _metrics(lay, it)["eval_accuracy"] is not None
    server_log = lay.job("both").log_file(0, "inference").read_text()
    assert "vllm.entrypoints.cli.main serve" in server_log or "Uvicorn" in server_log or "Started server" in server_log
