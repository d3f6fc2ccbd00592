"""`--bench` of the trainer and of SFT: fake data, warm-up steps, measured steps, a table and JSON.

    python -m train.trainer --bench [--model DIR] [--bench-seq-len 1024] [train key=value ...]
    python -m train.sft --bench ...                      (the SFT loss instead of GRPO's)
    torchrun --nproc-per-node 2 -m train.trainer --bench ...   (several processes)
    python -m train.trainer --bench --config my-run.yaml       (the levers of a run's YAML `train` section)

On a cluster, `scripts/run.sh ... --bench [--bench-* ...]` on every node (instead of --rl-phase)
runs `train.trainer --bench` as one multi-node torchrun with the run's `train` section and
rendezvous, and writes the JSON to `<log-path>/jobs/bench/bench.json` (rl/driver.py).

The model is built exactly as for training (train/build.py, so every lever applies) and trained
on random token sequences of `--bench-seq-len` tokens, `--bench-batch-size` sequences per
micro-batch and rank. Each measured step prints MFU, throughput, step time and peak memory; a
final row gives mean ± std. `--bench-output-json PATH` writes (keys):

    kind "baton-train-bench", entry ("trainer" | "sft"), model, parameters, trained_parameters,
    device, device_name, world_size, dtype, seq_len, batch_size, micro_batches, tokens_per_step,
    warmup_steps, measured_steps, flops_per_token, peak_tflops (per device, null if unknown),
    memory_before_steps_mb, config (the train section),
    steps: [{step, loss, mfu, tokens_per_s, step_time_s, peak_memory_mb}],
    mean / std: {mfu, tokens_per_s, step_time_s, peak_memory_mb},
    profiled_step (with --bench-profile-memory, else null): {tensors_before_mb (parameters, buffers,
    gradients, optimizer state), peak_above_mb (the step's peak tensor memory beyond those),
    peak_mb (their sum)}
    expert_bytes: bytes of expert weights rank 0 holds (its shards; 0 for a dense model),
    expert_bytes_computing: of one MoE layer while it runs (FSDP2 gathers all its experts, train.ep not)

MFU is a fraction (train/mfu.py); null when the peak is unknown (CPUs, unlisted GPUs) unless
`--bench-peak-tflops` gives it. Peak memory is the step's peak allocated memory on CUDA and the
process's peak resident set on CPU (train/memory.py says why).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import click

from coordination.config import apply_overrides, from_dict, load_yaml, to_dict
from coordination.records import atomic_output
from train.config import TrainConfig
from train.tiny import write_tiny_model

_log = logging.getLogger("baton.train.bench")

_COLUMNS = ("Step", "MFU", "Throughput (tokens/s)", "Step time", "Peak memory")


def bench_options(fn: Callable) -> Callable:
    """The --bench options shared by train.trainer and train.sft."""
    options = [
        click.option("--bench", is_flag=True, help="benchmark: train on fake data and print a step table (no output)"),
        click.option("--bench-warmup-steps", type=click.IntRange(0), default=2, show_default=True,
                     help="steps run before measuring (compilation, allocator warm-up)"),
        click.option("--bench-steps", type=click.IntRange(1), default=5, show_default=True, help="measured steps"),
        click.option("--bench-seq-len", type=click.IntRange(8), default=512, show_default=True,
                     help="tokens per fake sequence"),
        click.option("--bench-batch-size", type=click.IntRange(1), default=4, show_default=True,
                     help="sequences per micro-batch and rank"),
        click.option("--bench-micro-batches", type=click.IntRange(1), default=1, show_default=True,
                     help="micro-batches per step and rank (gradient accumulation)"),
        click.option("--bench-output-json", type=click.Path(path_type=Path, dir_okay=False), default=None,
                     help="also write the results as JSON here"),
        click.option("--bench-peak-tflops", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="peak TFLOP/s of one device for MFU (known GPUs are looked up; needed on CPU)"),
        click.option("--bench-profile-memory", is_flag=True,
                     help="after the measured steps, run one more step to measure its peak tensor memory (on CPU "
                          "with the PyTorch profiler, which slows that step down)"),
    ]
    return functools.reduce(lambda f, opt: opt(f), reversed(options), fn)


@contextlib.contextmanager
def bench_model(model: Path | None, seq_len: int) -> Iterator[Path]:
    """The folder to benchmark: `model`, or a tiny model written to a temporary folder for the
    duration. Call it before the process group exists: transformers saves only on rank 0 of one."""
    if model is not None:
        yield Path(model)
        return
    from train.model import quiet_transformers

    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="baton-bench-model-") as tmp:
        yield write_tiny_model(Path(tmp) / "tiny", max_positions=max(256, seq_len))


def _fake_rows(rng, vocab: int, seq_len: int, batch: int, algorithm: str) -> list[dict[str, Any]]:
    """Sequences of random tokens: a quarter prompt, the rest completion. Sampling logprobs of
    -log(vocab) keep a random model's importance ratios near 1, as after a real rollout."""
    prompt = max(1, seq_len // 4)
    rows = []
    for i in range(batch):
        ids = rng.integers(3, vocab, size=seq_len).tolist()
        row = {"prompt_ids": ids[:prompt], "completion_ids": ids[prompt:]}
        if algorithm == "grpo":
            row["logprobs"] = [-math.log(vocab)] * (seq_len - prompt)
            row["advantage"] = 1.0 if i % 2 == 0 else -1.0
        rows.append(row)
    return rows


def _mean_std(values: list[float | None]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def run_bench(cfg, opts: dict[str, Any], info, *, entry: str, algorithm: str) -> dict[str, Any]:
    """Collective: build, warm up, measure; returns the report (rank 0 prints and writes it)."""
    import numpy as np
    import torch

    from train.batches import collate
    from train.build import load_model, make_trainable, preflight
    from train.distributed import agreed
    from train.expert import expert_bytes, expert_bytes_computing
    from train.memory import peak_tensor_bytes, rss_mb
    from train.mfu import device_peak_tflops, flops_per_token, mfu
    from train.step import StepSettings, train_step

    agreed("checking the trainer settings", info, lambda: preflight(cfg, info))
    loaded = agreed("loading the model", info, lambda: load_model(cfg, Path(opts["model_path"]), None))
    lm = loaded.lm
    seq_len, batch, micro = opts["bench_seq_len"], opts["bench_batch_size"], opts["bench_micro_batches"]
    flops_token = flops_per_token(lm, seq_len)
    parameters = sum(p.numel() for p in lm.parameters())
    torch.manual_seed(cfg.seed)
    t = make_trainable(loaded, cfg, info)
    device_name = torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu"
    peak = opts["bench_peak_tflops"] or (device_peak_tflops(device_name) if info.device.type == "cuda" else None)
    settings = StepSettings(algorithm=algorithm, backend=cfg.backend, dtype=t.dtype, grad_clip=cfg.grad_clip)
    pad_id = lm.config.pad_token_id if lm.config.pad_token_id is not None else 0
    vocab = lm.get_output_embeddings().weight.shape[0]
    # The cp ranks of a context-parallel group train on the same sequences (train/context.py).
    data_ranks = info.world_size // cfg.cp
    rng = np.random.default_rng([cfg.seed, info.rank // cfg.cp])
    completion = (seq_len - max(1, seq_len // 4)) * batch * micro * data_ranks
    memory_before = torch.cuda.memory_allocated(info.device) / 2**20 if info.device.type == "cuda" else rss_mb()
    t.model.train()
    rows = []
    total = opts["bench_warmup_steps"] + opts["bench_steps"]
    for step in range(total):
        batches = [collate(_fake_rows(rng, vocab, seq_len, batch, algorithm), pad_id) for _ in range(micro)]
        m = train_step(t.model, t.params, t.optimizer, batches, lr=cfg.lr, global_completion_tokens=completion,
                       settings=settings, info=info, router_loss=t.router_loss)
        if step < opts["bench_warmup_steps"]:
            if info.is_main:
                _log.info("warm-up step %d/%d: %.2f s", step + 1, opts["bench_warmup_steps"], m.seconds)
            continue
        rows.append({"step": step + 1 - opts["bench_warmup_steps"], "loss": m.loss,
                     "mfu": mfu(flops_token, m.tokens_per_s, peak, info.world_size), "tokens_per_s": m.tokens_per_s,
                     "step_time_s": m.seconds, "peak_memory_mb": m.peak_memory_mb})
    keys = ("mfu", "tokens_per_s", "step_time_s", "peak_memory_mb")
    stats = {k: _mean_std([r[k] for r in rows]) for k in keys}
    profiled = None
    if opts.get("bench_profile_memory"):
        batches = [collate(_fake_rows(rng, vocab, seq_len, batch, algorithm), pad_id) for _ in range(micro)]
        before = resident_tensor_mb(t)
        _, above = peak_tensor_bytes(lambda: train_step(t.model, t.params, t.optimizer, batches, lr=cfg.lr,
                                                        global_completion_tokens=completion, settings=settings,
                                                        info=info, router_loss=t.router_loss), info.device)
        profiled = {"tensors_before_mb": before, "peak_above_mb": above / 2**20, "peak_mb": before + above / 2**20}

    return {"kind": "baton-train-bench", "entry": entry, "model": str(opts.get("model") or "train.tiny default"),
            "parameters": parameters, "trained_parameters": sum(p.numel() for p in t.params),
            "device": info.device.type, "device_name": device_name, "world_size": info.world_size,
            "dtype": str(t.dtype).removeprefix("torch."), "seq_len": seq_len, "batch_size": batch,
            "micro_batches": micro, "tokens_per_step": seq_len * batch * micro * data_ranks,
            "warmup_steps": opts["bench_warmup_steps"], "measured_steps": opts["bench_steps"],
            "flops_per_token": flops_token, "peak_tflops": peak, "memory_before_steps_mb": memory_before,
            "config": to_dict(cfg), "steps": rows,
            "mean": {k: stats[k][0] for k in keys}, "std": {k: stats[k][1] for k in keys},
            "profiled_step": profiled, "expert_bytes": expert_bytes(t.policy.lm),
            "expert_bytes_computing": expert_bytes_computing(t.policy.lm)}


def resident_tensor_mb(t) -> float:
    """This rank's parameters, buffers, gradients and optimizer state (each storage once), in MiB."""
    import torch

    tensors = [*t.policy.parameters(), *t.policy.buffers()]
    tensors += [p.grad for p in t.policy.parameters() if p.grad is not None]
    tensors += [v for state in t.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {}
    for x in tensors:
        local = x.to_local() if hasattr(x, "to_local") else x
        storage = local.untyped_storage()
        storages[(local.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()) / 2**20


_FORMATS = {"mfu": "{:.2%}", "tokens_per_s": "{:,.0f}", "step_time_s": "{:.3f} s", "peak_memory_mb": "{:,.0f} MiB"}


def _fmt(key: str, value: float | None, std: float | None = None) -> str:
    if value is None:
        return "n/a"
    unit = _FORMATS[key]
    text = unit.format(value)
    if std is not None:
        text += " ± " + unit.format(std)
    return text


def render_table(report: dict[str, Any]):
    from rich.table import Table

    memory = "peak allocated" if report["device"] == "cuda" else "process peak RSS"
    table = Table(title=f"{report['entry']} bench: {report['parameters']:,} parameters, {report['world_size']} x "
                        f"{report['device_name']}, {report['tokens_per_step']:,} tokens/step, seq {report['seq_len']}, "
                        f"after {report['warmup_steps']} warm-up steps (memory: {memory})")
    for col in _COLUMNS:
        table.add_column(col, justify="right")
    keys = ("mfu", "tokens_per_s", "step_time_s", "peak_memory_mb")
    for r in report["steps"]:
        table.add_row(str(r["step"]), *(_fmt(k, r[k]) for k in keys))
    table.add_section()
    table.add_row("mean ± std", *(_fmt(k, report["mean"][k], report["std"][k]) for k in keys))
    return table


def print_and_write(report: dict[str, Any], output_json: Path | None) -> None:
    from rich.console import Console

    Console(width=160).print(render_table(report))
    if report["device"] != "cuda" and report["peak_tflops"] is None:
        click.echo("MFU needs the device's peak: pass --bench-peak-tflops (CPUs have no table entry)")
    if output_json is not None:
        with atomic_output(output_json) as tmp:
            Path(tmp).write_text(json.dumps(report, indent=1) + "\n")


def train_config_from(base: dict[str, Any], config_files: tuple[Path, ...], overrides: tuple[str, ...]):
    """TrainConfig from `base` values <- the `train` section of YAML files <- key=value overrides
    (keys with or without the `train.` prefix)."""
    def merge(into: dict, extra: dict) -> dict:
        out = dict(into)
        for k, v in extra.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    data = dict(base)
    for f in config_files:
        data = merge(data, load_yaml(f).get("train") or {})
    keys = [o.removeprefix("train.") for o in overrides]
    return from_dict(TrainConfig, apply_overrides(TrainConfig, data, keys))
