"""`--bench` of the trainer and of SFT, `python -m train.bench --levers`, and misconfigurations
that must stop the trainer with a message saying what to change."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests import train_support as ts

STEP_KEYS = {"step", "loss", "mfu", "tokens_per_s", "step_time_s", "peak_memory_mb"}
REPORT_KEYS = {"kind", "entry", "model", "parameters", "trained_parameters", "device", "device_name", "world_size",
               "dtype", "seq_len", "batch_size", "micro_batches", "tokens_per_step", "warmup_steps",
               "measured_steps", "flops_per_token", "peak_tflops", "memory_before_steps_mb", "config", "steps",
               "mean", "std", "profiled_step", "expert_bytes", "expert_bytes_computing"}
SMALL = ["--bench-warmup-steps", "1", "--bench-steps", "2", "--bench-seq-len", "32", "--bench-batch-size", "2"]


def _bench(module: str, args: list[str], tmp_path: Path, name: str) -> tuple[int, str]:
    log = tmp_path / f"{name}.log"
    rc = ts.run_module(module, ["--bench", *SMALL, *args], log, timeout=120)
    return rc, log.read_text()


def test_trainer_bench_prints_the_step_table_and_writes_the_documented_json(tmp_path):
    out = tmp_path / "bench.json"
    rc, text = _bench("train.trainer", ["--bench-peak-tflops", "0.5", "--bench-output-json", str(out), "ac.freq=1",
                                        "train.lora.rank=4"], tmp_path, "trainer")
    assert rc == 0, text
    for column in ("Step", "MFU", "Throughput (tokens/s)", "Step time", "Peak memory", "mean ± std"):
        assert column in text
    report = json.loads(out.read_text())
    assert set(report) == REPORT_KEYS and report["kind"] == "baton-train-bench" and report["entry"] == "trainer"
    assert report["config"]["ac"]["freq"] == 1 and report["config"]["lora"]["rank"] == 4
    assert report["trained_parameters"] < report["parameters"] / 10          # LoRA: adapters only
    assert report["tokens_per_step"] == 64 and report["peak_tflops"] == 0.5
    assert [s["step"] for s in report["steps"]] == [1, 2] and all(set(s) == STEP_KEYS for s in report["steps"])
    for s in report["steps"]:
        assert s["tokens_per_s"] > 0 and s["step_time_s"] > 0 and s["peak_memory_mb"] > 0
        assert s["mfu"] == pytest.approx(report["flops_per_token"] * s["tokens_per_s"] / 0.5e12)
    mean = sum(s["tokens_per_s"] for s in report["steps"]) / 2
    assert report["mean"]["tokens_per_s"] == pytest.approx(mean) and report["std"]["tokens_per_s"] >= 0
    assert f"{100 * report['steps'][0]['mfu']:.2f}%" in text


def test_flops_per_token_follows_the_documented_formula(tmp_path):
    from train.mfu import device_peak_tflops, flops_per_token
    from train.model import load_causal_lm

    lm = load_causal_lm(ts.make_tiny(tmp_path / "m", layers=2))
    cfg = lm.config          # hidden 128, 4 heads of 32, 2 kv heads, intermediate 384, tied head
    per_block = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384
    matmul = 2 * per_block + cfg.vocab_size * 128                      # the tied LM head counts
    assert flops_per_token(lm, 100) == 6 * matmul + 12 * 2 * 4 * 32 * 100
    assert [device_peak_tflops(n) for n in ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200",
                                            "NVIDIA B200", "NVIDIA H100 PCIe", "Tesla V100")] == \
        [312.0, 989.0, 989.0, 2250.0, 756.0, None]


def test_sft_bench_on_cpu_shows_mfu_only_with_a_given_peak(tmp_path):
    out = tmp_path / "sft.json"
    rc, text = _bench("train.sft", ["--bench-output-json", str(out)], tmp_path, "sft")
    assert rc == 0, text
    report = json.loads(out.read_text())
    assert report["entry"] == "sft" and report["peak_tflops"] is None
    assert all(s["mfu"] is None for s in report["steps"]) and report["mean"]["mfu"] is None
    assert "n/a" in text and "pass --bench-peak-tflops" in text


@pytest.mark.parametrize("args, message", [
    (["fsdp_cpu_offload=true", "optim_cpu_offload=true"],
     "train.fsdp_cpu_offload and train.optim_cpu_offload are mutually exclusive"),
    (["dp_replicate=2"], r"train.dp_replicate=2 does not divide the number of trainer processes \(1 "),
    pytest.param(["attn=flash_attention_2"], "needs the flash-attn package, which is not installed",
                 marks=pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                                          reason="flash-attn is installed here")),
], ids=["both-offloads", "bad-dp-replicate", "flash-attention-without-flash-attn"])
def test_misconfigured_levers_exit_2_with_what_to_change(tmp_path, args, message):
    import re

    rc, text = _bench("train.trainer", args, tmp_path, "bad")
    assert rc == 2, text
    assert re.search(message, text), text
    assert "Traceback" not in text


@pytest.mark.slow
def test_bench_under_torchrun_uses_hsdp_over_two_processes(tmp_path):
    out = tmp_path / "hsdp.json"
    codes = ts.torchrun("train.trainer", ["--bench", *SMALL, "--bench-output-json", str(out), "dp_replicate=2"],
                        tmp_path / "logs", nnodes=1, nproc_per_node=2)
    assert codes == [0], ts.logs_text(tmp_path / "logs")
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["config"]["dp_replicate"] == 2 and report["tokens_per_step"] == 128
    assert "HSDP 2x1" in ts.logs_text(tmp_path / "logs")


def _planned_moe_peak_mb(tmp_path: Path, ep: int) -> float:
    """train/trainer_memory.py's peak for the levers bench's ep row (float32 on CPU, 2 processes),
    less the fixed CUDA context and allocator terms a CPU process does not have."""
    from dataclasses import replace

    from bench.levers_ep import BATCH, EXPERTS, SEQ_LEN, TOP_K
    from train.config import TrainConfig
    from train.model_shape import GIB, ModelShape
    from train.trainer_memory import TRAINER_OVERHEAD_GIB, trainer_memory

    model = tmp_path / "plan-moe"
    if not model.exists():
        ts.make_tiny(model, experts=EXPERTS, top_k=TOP_K, max_positions=SEQ_LEN)
    train = replace(TrainConfig(), dtype="float32", micro_batch_tokens=SEQ_LEN * BATCH, ep=ep,
                    fused_lm_head_token_chunk_size="disabled")
    memory = trainer_memory(ModelShape.from_model_dir(model), train, 2, on_gpu=False)
    return (memory.peak - TRAINER_OVERHEAD_GIB * GIB) / 2**20


@pytest.mark.slow
def test_lever_benchmark_reports_every_lever_as_a_ratio_to_plain(tmp_path):
    import subprocess

    # The cp row is tested on its own below (it needs heads that 2 divides).
    proc = subprocess.run([sys.executable, "-m", "train.bench", "--levers", "--json", "--hidden", "64", "--layers",
                           "2", "--vocab", "512", "--seq-len", "64", "--steps", "1", "--cp-seq-len", "0"],
                          cwd=ts.REPO, env=ts.env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {r["lever"]: r for r in report["results"]}
    assert list(rows) == ["plain", "ac", "ac_offloading", "chunked_logprobs", "lora", "compile", "ep"]
    assert rows["plain"]["tokens_per_s_ratio"] == 1.0 and rows["plain"]["peak_memory_mb_ratio"] == 1.0
    ep = rows.pop("ep")   # its ratios are to ep=1 on 2 processes
    assert ep["expert_bytes_computing_per_rank_ratio"] == 0.5 and ep["expert_bytes_per_rank_ratio"] == 1.0
    assert ep["tokens_per_s"] > 0 and ep["tokens_per_s_ratio"] == pytest.approx(
        ep["tokens_per_s"] / ep["baseline_tokens_per_s"])
    # The memory plan's step peak (without its fixed CUDA terms) against the profiled one, within 15%.
    for key, ep_degree in (("peak_memory_mb", 2), ("baseline_peak_memory_mb", 1)):
        assert _planned_moe_peak_mb(tmp_path, ep_degree) == pytest.approx(ep[key], rel=0.15), key
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
        assert r["peak_memory_mb"] == pytest.approx(r["resident_tensors_mb"] + r["step_allocations_mb"])
        assert r["tokens_per_s_ratio"] == pytest.approx(r["tokens_per_s"] / rows["plain"]["tokens_per_s"])
        assert r["peak_memory_mb_ratio"] == pytest.approx(r["peak_memory_mb"] / rows["plain"]["peak_memory_mb"])
    # Activation checkpointing and the chunked head allocate less during the step, measurably even here.
    assert rows["ac"]["step_allocations_mb"] < rows["plain"]["step_allocations_mb"]
    assert rows["chunked_logprobs"]["step_allocations_mb"] < rows["plain"]["step_allocations_mb"]
    assert rows["lora"]["trained_parameters"] < rows["plain"]["trained_parameters"]


@pytest.mark.slow
def test_cp_row_compares_cp2_with_cp1_on_the_same_two_processes(tmp_path):
    from bench.context_levers import run_cp_row
    from bench.levers import write_small_llama

    # hidden 256: 4 heads and 2 kv heads, which cp=2 divides.
    write_small_llama(tmp_path / "m", hidden=256, layers=2, vocab=512, seq_len=512)
    row = run_cp_row(tmp_path / "m", {"cp_seq_len": 512, "warmup_steps": 1, "steps": 1, "threads": 1,
                                      "timeout": 600}, tmp_path, echo=lambda _: None)
    # One sequence per step instead of two, each rank holding half of it: less allocated per rank.
    assert row["lever"] == "cp" and row["overrides"][-1] == "cp=2" and row["baseline"]["overrides"][-1] == "cp=1"
    assert row["tokens_per_step"] == 512 and row["baseline"]["tokens_per_step"] == 1024
    assert row["step_allocations_mb_ratio"] == pytest.approx(row["step_allocations_mb"] /
                                                             row["baseline"]["step_allocations_mb"])
    assert row["step_allocations_mb_ratio"] < 1 and row["tokens_per_s"] > 0


def test_run_sh_bench_runs_the_benchmark_as_one_torchrun_over_two_nodes(procs, tmp_path):
    """scripts/run.sh --bench on a master and a worker: they join like a run, meet at the master's
    rendezvous and run one 2-process benchmark of the run's `train` levers; the master prints the
    table, the JSON lands in the job folder, and no checkpoint or rollout is written."""
    from coordination.layout import RunLayout
    from tests.e2e import RUN_SH, fresh_log

    log = fresh_log(tmp_path)
    common = [RUN_SH, "--data-path", str(tmp_path / "unused-data"), "--log-path", str(log), "--bench", *SMALL,
              "--num-nodes", "2", "--rank-weights", "1,1", "train.backend=fsdp", "train.ac.freq=1",
              "coordination.heartbeat_interval=0.5"]
    procs.start("n0", common + ["--master"])
    procs.start("n1", common + ["--worker", "1"])
    assert procs.wait_all(300) == {"n0": 0, "n1": 0}, procs.log("n0")[-3000:] + procs.log("n1")[-3000:]
    lay = RunLayout(log)
    report = json.loads(lay.job("bench").bench_json.read_text())
    assert set(report) == REPORT_KEYS and report["world_size"] == 2 and report["config"]["ac"]["freq"] == 1
    assert report["config"]["backend"] == "fsdp" and len(report["steps"]) == 2
    assert report["tokens_per_step"] == 2 * 64                  # 2 sequences of 32 tokens on each of 2 ranks
    console = procs.log("n0")
    for column in ("Throughput (tokens/s)", "Step time", "Peak memory", "mean ± std"):
        assert column in console
    assert "benchmark done" in console and "benchmark done" in procs.log("n1")
    assert not lay.checkpoints_dir.exists() and not (log / "rollouts").exists()
