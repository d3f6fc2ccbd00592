"""The `cp` row of `python -m bench --what levers`: context parallelism (train.cp=2, Ulysses)
against cp=1, both on 2 torchrun processes, on `--cp-seq-len`-token sequences (8192).

Both launches run `train.trainer --bench` on the same small Llama with the chunked LM head
(256-token chunks). With
cp=1 the 2 processes are 2 data ranks, each training its own sequence per step; with cp=2 they
are one CP group splitting one sequence, so a step holds half the tokens and each rank half of
them again. Reported per rank 0, as ratios to cp=1: the step's tensor allocations beyond the
resident state (activations, logits, gathered weights, gradients; the PyTorch profiler, as for
the other rows), tokens/s of the whole step and peak RSS. The target of the row: allocations
ratio <= 0.65 (half the positions per rank, plus what does not split: gathered weights, the
head's chunk buffers, gradients and the all-to-all buffers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import click

from coordination.net import free_port
from coordination.procgroup import start_child
from train.launch import torchrun_command, torchrun_env

REPO = Path(__file__).resolve().parents[1]
# A fixed head chunk: its [chunk, vocab] buffers are the same at any length, and 256 tokens keeps
# them small beside the activations that context parallelism splits.
CP_LEVERS = ["fused_lm_head_token_chunk_size=256"]
TARGET_RATIO = 0.65


def _launch(model: Path, cp: int, out: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """One 2-process `train.trainer --bench` under torchrun; its JSON report."""
    port = free_port("127.0.0.1")
    args = ["--bench", "--model", str(model), "--bench-seq-len", str(opts["cp_seq_len"]),
            "--bench-batch-size", "1", "--bench-warmup-steps", str(opts["warmup_steps"]),
            "--bench-steps", str(opts["steps"]), "--bench-output-json", str(out), "--bench-profile-memory",
            *CP_LEVERS, f"cp={cp}"]
    cmd = torchrun_command(python=sys.executable, nnodes=1, node_rank=0, nproc_per_node=2,
                           rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"bench-cp-{port}", is_host=True,
                           local_addr=None, module="train.trainer", args=args)
    env = torchrun_env(dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"), omp_threads=opts["threads"],
                       socket_ifname=None)
    log = out.with_suffix(".log")
    child = start_child(cmd, env=env, log_file=log, what=f"levers bench cp={cp}")
    try:
        rc = child.wait(opts["timeout"])
    except subprocess.TimeoutExpired:
        child.stop()
        raise click.ClickException(f"cp={cp} did not finish within {opts['timeout']} s; see {log}") from None
    child.join_output()
    if rc != 0:
        raise click.ClickException(f"cp={cp} failed (exit {rc}):\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def run_cp_row(model: Path, opts: dict[str, Any], tmp: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """The `cp` row: cp=2 against cp=1 (module docstring); the cp=1 numbers ride along as `baseline`."""
    runs = {}
    for cp in (1, 2):
        report = _launch(model, cp, tmp / f"cp{cp}.json", opts)
        profiled = report["profiled_step"]
        runs[cp] = {"tokens_per_s": report["mean"]["tokens_per_s"], "tokens_per_s_std": report["std"]["tokens_per_s"],
                    "step_time_s": report["mean"]["step_time_s"], "peak_memory_mb": profiled["peak_mb"],
                    "resident_tensors_mb": profiled["tensors_before_mb"], "step_allocations_mb": profiled["peak_above_mb"],
                    "peak_rss_mb": report["mean"]["peak_memory_mb"], "tokens_per_step": report["tokens_per_step"],
                    "trained_parameters": report["trained_parameters"]}
        echo(f"cp={cp}: {runs[cp]['tokens_per_s']:,.0f} tokens/s, step allocations "
             f"{runs[cp]['step_allocations_mb']:,.0f} MiB per rank")
    row = {"lever": "cp", "overrides": CP_LEVERS + ["cp=2"], "processes": 2, "seq_len": opts["cp_seq_len"],
           **runs[2], "baseline": {"overrides": CP_LEVERS + ["cp=1"], **runs[1]}}
    for key in ("tokens_per_s", "peak_memory_mb", "step_allocations_mb", "peak_rss_mb"):
        row[f"{key}_ratio"] = runs[2][key] / runs[1][key]
    row["activation_ratio_target"] = TARGET_RATIO
    return row
