"""The `ep` row of `python -m bench --what levers`: expert parallelism on the tiny MoE.

`python -m train.tiny --moe` (Qwen3-MoE, 8 experts top-2, 4 layers, hidden 128) trains on fake
sequences through `train.trainer --bench` under one torchrun of 2 processes, once with train.ep=1
(FSDP2 shards every weight, experts too, over both ranks and gathers each block's experts for
its forward and backward) and once with train.ep=2 (each rank keeps 4 whole experts per layer;
tokens reach them by all-to-all). The row has the other levers' keys (tokens/s, peak memory of a
step from the profiler, peak RSS), as ratios to ep=1 on the same 2 processes, not to the Llama's
plain row, plus two expert byte counts of rank 0: `expert_bytes_per_rank`, what it keeps between
steps (both halve the experts over 2 ranks: FSDP2 by rows of every expert tensor, ep=2 as whole
experts; ratio 1), and `expert_bytes_computing_per_rank`, what it holds of one layer's experts
while the layer runs: FSDP2 all-gathers all of them, ep=2 uses its own half and gathers none
(ratio 0.5).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from coordination.net import free_port
from coordination.procgroup import start_child
from train.launch import torchrun_command, torchrun_env
from train.tiny import write_tiny_model

REPO = Path(__file__).resolve().parents[1]
PROCESSES = 2
EXPERTS, TOP_K = 8, 2
SEQ_LEN, BATCH = 256, 4  # the tiny model's positions; sequences per rank and step


def _run(model: Path, ep: int, tmp: Path, opts: dict[str, Any]) -> dict[str, Any]:
    """One torchrun of `train.trainer --bench` on PROCESSES processes at train.ep=`ep`; rank 0's report."""
    out = tmp / f"ep{ep}.json"
    port = free_port("127.0.0.1")
    args = ["--bench", "--model", str(model), "--bench-seq-len", str(SEQ_LEN),
            "--bench-batch-size", str(BATCH), "--bench-warmup-steps", str(opts["warmup_steps"]),
            "--bench-steps", str(opts["steps"]), "--bench-output-json", str(out), "--bench-profile-memory",
            "fused_lm_head_token_chunk_size=disabled", f"ep={ep}"]
    cmd = torchrun_command(python=sys.executable, nnodes=1, node_rank=0, nproc_per_node=PROCESSES,
                           rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"bench-ep-{port}", is_host=True,
                           local_addr=None, module="train.trainer", args=args)
    env = torchrun_env(dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"), omp_threads=opts["threads"],
                       socket_ifname=None)
    log = tmp / f"ep{ep}.log"
    child = start_child(cmd, env=env, log_file=log, what=f"levers bench, train.ep={ep} on {PROCESSES} processes")
    try:
        rc = child.wait(opts["timeout"])
    except subprocess.TimeoutExpired:
        raise click.ClickException(f"train.ep={ep} on {PROCESSES} processes did not finish within "
                                   f"{opts['timeout']:.0f} s (--timeout); see {log}") from None
    finally:
        if child.poll() is None:   # timed out or interrupted: the whole torchrun group goes
            child.stop()
    child.join_output()
    if rc != 0 or not out.exists():
        raise click.ClickException(f"train.ep={ep} on {PROCESSES} processes failed (exit {rc}); see {log}:\n"
                                   f"{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


def run_ep_row(opts: dict[str, Any], tmp: Path, echo) -> dict[str, Any]:
    """The `ep` row: train.ep=2 against train.ep=1, both on PROCESSES processes."""
    model = write_tiny_model(tmp / "tiny-moe", experts=EXPERTS, top_k=TOP_K, max_positions=SEQ_LEN)
    base, ep2 = (_run(model, ep, tmp, opts) for ep in (1, 2))
    row = {"lever": "ep", "overrides": ["ep=2"], "baseline": f"ep=1 on the same {PROCESSES} processes",
           "model": f"tiny Qwen3-MoE, {EXPERTS} experts top-{TOP_K}", "processes": PROCESSES,
           "seq_len": SEQ_LEN, "parameters": ep2["parameters"]}
    for name, report in (("", ep2), ("baseline_", base)):
        profiled = report["profiled_step"]
        row.update({f"{name}tokens_per_s": report["mean"]["tokens_per_s"],
                    f"{name}step_time_s": report["mean"]["step_time_s"],
                    f"{name}peak_memory_mb": profiled["peak_mb"],
                    f"{name}resident_tensors_mb": profiled["tensors_before_mb"],
                    f"{name}step_allocations_mb": profiled["peak_above_mb"],
                    f"{name}peak_rss_mb": report["mean"]["peak_memory_mb"],
                    f"{name}expert_bytes_per_rank": report["expert_bytes"],
                    f"{name}expert_bytes_computing_per_rank": report["expert_bytes_computing"]})
    for key in ("tokens_per_s", "peak_memory_mb", "step_allocations_mb", "peak_rss_mb", "expert_bytes_per_rank",
                "expert_bytes_computing_per_rank"):
        row[f"{key}_ratio"] = row[key] / row[f"baseline_{key}"]
    echo(f"ep: {row['tokens_per_s']:,.0f} tokens/s (ep=1: {row['baseline_tokens_per_s']:,.0f}), a layer's expert "
         f"bytes per rank while it runs x{row['expert_bytes_computing_per_rank_ratio']:.2f}, step peak "
         f"{row['peak_memory_mb']:,.0f} MiB (ep=1: {row['baseline_peak_memory_mb']:,.0f})")
    return row
