"""`python -m bench --what levers [--json]`: each memory/speed lever against the plain trainer.

A small Llama (about 40M parameters by default: hidden 512, 8 layers, vocabulary 32,000) trains
on fake 1,024-token sequences through `python -m train.trainer --bench`, once per configuration,
each in a fresh process: plain (all logits at once), ac (every block checkpointed),
ac_offloading, chunked logprobs, LoRA (rank 16 on every projection) and torch.compile; then `ep`,
the tiny MoE at train.ep=2 against ep=1 on 2 processes (bench/levers_ep.py); last, the `cp` row
(bench/context_levers.py: train.cp=2 against cp=1 on 2 processes and 8k-token sequences, its
ratios to that cp=1 run; `--cp-seq-len 0` leaves it out). Reported per configuration, and as a
ratio to plain from the same run:

- tokens/s: mean over the measured steps (after warm-up, which includes compilation);
- peak memory of a step: the tensors resident when a step starts (parameters, buffers,
  optimizer state) plus the highest amount the step allocates beyond them (activations, logits,
  gradients, optimizer temporaries), measured on one extra step with the PyTorch profiler, which
  sees every allocation of the CPU allocator (train/memory.py). This is the CPU counterpart of
  torch.cuda.max_memory_allocated;
- peak RSS of the process, for reference: it adds the Python runtime and libraries (~0.5 GiB)
  and whatever the C allocator keeps after frees, so ratios of it understate every lever.

On CPU, activation offloading has no slower memory to move to: it copies activations within the
same memory, so it costs time and saves nothing here (the lever is for GPUs, where it moves them
from device to host memory). Its row shows that cost, not its benefit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from bench.levers_ep import run_ep_row
from bench.context_levers import run_cp_row

REPO = Path(__file__).resolve().parents[1]

PLAIN = ["fused_lm_head_token_chunk_size=disabled"]
LEVERS: list[tuple[str, list[str]]] = [
    ("plain", PLAIN),
    ("ac", PLAIN + ["ac.freq=1"]),
    ("ac_offloading", PLAIN + ["ac_offloading.enabled=true"]),
    ("chunked_logprobs", ["fused_lm_head_token_chunk_size=auto"]),
    ("lora", PLAIN + ["lora.rank=16", "lora.alpha=32"]),
    ("compile", PLAIN + ["compile={}"]),
]


def write_small_llama(out: Path, *, hidden: int, layers: int, vocab: int, seq_len: int, seed: int = 0) -> int:
    """A randomly initialised Llama folder (no tokenizer: the benchmark feeds token ids); returns its size."""
    # torch and transformers only once a model is built, so that --help answers at once.
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from train.model import quiet_transformers  # imports torch

    quiet_transformers()
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         head_dim=hidden // heads, max_position_embeddings=seq_len, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _run(model: Path, overrides: list[str], out: Path, opts: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "train.trainer", "--bench", "--model", str(model),
           "--bench-seq-len", str(opts["seq_len"]), "--bench-batch-size", str(opts["batch_size"]),
           "--bench-warmup-steps", str(opts["warmup_steps"]), "--bench-steps", str(opts["steps"]),
           "--bench-output-json", str(out), "--bench-profile-memory", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(opts["threads"]), PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=opts["timeout"],
                          start_new_session=True)
    if proc.returncode != 0:
        raise click.ClickException(f"{' '.join(overrides)} failed (exit {proc.returncode}):\n"
                                   f"{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(out.read_text())


def run_levers(opts: dict[str, Any], tmp: Path, echo) -> dict[str, Any]:
    model = tmp / "small-llama"
    params = write_small_llama(model, hidden=opts["hidden"], layers=opts["layers"], vocab=opts["vocab"],
                               seq_len=max(opts["seq_len"], opts["cp_seq_len"]))
    rows = []
    for name, overrides in LEVERS:
        report = _run(model, overrides, tmp / f"{name}.json", opts)
        profiled = report["profiled_step"]
        rows.append({"lever": name, "overrides": overrides, "tokens_per_s": report["mean"]["tokens_per_s"],
                     "tokens_per_s_std": report["std"]["tokens_per_s"], "step_time_s": report["mean"]["step_time_s"],
                     "peak_memory_mb": profiled["peak_mb"], "resident_tensors_mb": profiled["tensors_before_mb"],
                     "step_allocations_mb": profiled["peak_above_mb"], "peak_rss_mb": report["mean"]["peak_memory_mb"],
                     "trained_parameters": report["trained_parameters"]})
        echo(f"{name}: {rows[-1]['tokens_per_s']:,.0f} tokens/s, peak memory {rows[-1]['peak_memory_mb']:,.0f} MiB")
    plain = rows[0]
    for r in rows:
        for key in ("tokens_per_s", "peak_memory_mb", "step_allocations_mb", "peak_rss_mb"):
            r[f"{key}_ratio"] = r[key] / plain[key]
    rows.append(run_ep_row(opts, tmp, echo))  # its ratios are to ep=1 on 2 processes (bench/levers_ep.py)
    if opts["cp_seq_len"]:
        rows.append(run_cp_row(model, opts, tmp, echo))  # its ratios are to cp=1 on the same 2 processes
    return {"model": {"parameters": params, "hidden": opts["hidden"], "layers": opts["layers"], "vocab": opts["vocab"]},
            "seq_len": opts["seq_len"], "batch_size": opts["batch_size"], "warmup_steps": opts["warmup_steps"],
            "measured_steps": opts["steps"], "threads_per_process": opts["threads"], "device": "cpu",
            "cpus": os.cpu_count(), "results": rows}


def print_levers(report: dict[str, Any]) -> None:
    m = report["model"]
    table = Table(title=f"bench --what levers: Llama {m['parameters'] / 1e6:.1f}M parameters (hidden {m['hidden']}, "
                        f"{m['layers']} layers, vocab {m['vocab']:,}), {report['batch_size']} x {report['seq_len']} "
                        f"tokens per step, CPU, {report['threads_per_process']} thread(s)")
    for col in ("lever", "tokens/s", "x plain", "step s", "peak memory", "x plain", "of which the step", "x plain",
                "peak RSS", "x plain"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(r["lever"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_ratio']:.2f}",
                      f"{r['step_time_s']:.2f}", f"{r['peak_memory_mb']:,.0f} MiB", f"{r['peak_memory_mb_ratio']:.2f}",
                      f"{r['step_allocations_mb']:,.0f} MiB", f"{r['step_allocations_mb_ratio']:.2f}",
                      f"{r['peak_rss_mb']:,.0f} MiB", f"{r['peak_rss_mb_ratio']:.2f}")
    Console(width=160).print(table)
