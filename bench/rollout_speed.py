"""Rollout benchmarks: `python -m bench --what rollout [--json]`.

(a) aggregation of 8 ranks x 100,000 synthetic samples (target <= 3 s);
(b) samples/s and tokens/s of the transformers engine on the tiny model;
(c) the same for vLLM on CPU when the vLLM tier is installed (`--vllm-python` or BATON_VLLM_PYTHON).
`--env` (`--what env`) instead: environment episodes at concurrency 1 and 32 (bench/env_speed.py).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
from rich.console import Console
from rich.table import Table

from bench.env_speed import run_env_bench
from bench.vllm_speed import measure_vllm
from coordination import log
from coordination.layout import RunLayout
from coordination.records import restrict_umask
from rollout import store
from rollout.aggregate import aggregate
from rollout.chunks import GENERATION_KEY, RUN_ID_KEY, Manifest, publish_done
from rollout.engine import Sampling
from rollout.engines.transformers_engine import TransformersEngine
from train.tiny import write_tiny_model

AGGREGATE_TARGET_S = 3.0


def synthetic_chunk(rank: int, first_task: int, tasks: int, group_size: int, iteration: int, seed: int) -> Any:
    """A chunk table of `tasks` groups built column-wise (prompt 10, completion 1-8 tokens)."""
    rng = np.random.default_rng(seed)
    rows = tasks * group_size
    task_ids = pa.array([f"r{rank}-t{first_task + i}" for i in range(tasks)]).take(
        pa.array(np.repeat(np.arange(tasks), group_size)))
    comp_len = rng.integers(1, 9, rows)
    comp_off = np.concatenate([[0], np.cumsum(comp_len)]).astype(np.int32)
    prompt_off = np.arange(0, 10 * rows + 1, 10, dtype=np.int32)
    n_comp = int(comp_off[-1])
    ints = lambda n: pa.array(rng.integers(4, 50, n).astype(np.int32))  # noqa: E731
    columns = {
        "task_id": task_ids,
        "sample_index": pa.array(np.tile(np.arange(group_size, dtype=np.int32), tasks)),
        "prompt": pa.array(["123+456="] * rows),
        "prompt_ids": pa.ListArray.from_arrays(pa.array(prompt_off), ints(10 * rows)),
        "completion_ids": pa.ListArray.from_arrays(pa.array(comp_off), ints(n_comp)),
        "logprobs": pa.ListArray.from_arrays(pa.array(comp_off), pa.array(-rng.random(n_comp, dtype=np.float32))),
        "loss_mask": pa.ListArray.from_arrays(pa.array(comp_off), pa.array(np.ones(n_comp, np.int8))),
        "turn_starts": pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32)),
                                                pa.array(np.zeros(rows, np.int32))),
        "turns": pa.array(np.ones(rows, np.int32)),
        "termination": pa.array(["done"] * rows),
        "error": pa.array([None] * rows, pa.string()),
        "step_rewards": pa.array([[]] * rows, pa.list_(pa.float32())),
        "reward_parts": pa.array([[]] * rows, store.SCHEMA.field("reward_parts").type),
        "text": pa.array(["579"] * rows),
        "reward": pa.array((rng.random(rows) < 0.3).astype(np.float32)),
        "finish_reason": pa.array(np.where(comp_len < 8, "stop", "length")),
        "policy_iteration": pa.array(np.full(rows, iteration - 1, np.int32)),
        "iteration": pa.array(np.full(rows, iteration, np.int32)),
        "split": pa.array(["train"] * rows),
        "rank": pa.array(np.full(rows, rank, np.int32)),
        "generation": pa.array(np.ones(rows, np.int32)),
    }
    return pa.table(columns).cast(store.SCHEMA)


def bench_aggregate(ranks: int = 8, samples_per_rank: int = 100_000, group_size: int = 8,
                    chunk_tasks: int = 1250) -> dict[str, Any]:
    run_id, iteration = "bench", 1
    tasks_per_rank = samples_per_rank // group_size
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as tmp:
        layout = RunLayout(Path(tmp))
        for rank in range(ranks):
            manifest = Manifest("train", iteration, rank, group_size, iteration - 1, seconds=10.0)
            for seq, first in enumerate(range(0, tasks_per_rank, chunk_tasks)):
                n = min(chunk_tasks, tasks_per_rank - first)
                table = synthetic_chunk(rank, first, n, group_size, iteration, seed=rank * 1000 + seq)
                table = table.replace_schema_metadata({RUN_ID_KEY: run_id.encode(), GENERATION_KEY: b"1"})
                path = layout.rollout_chunk("train", iteration, rank, seq, 1)
                store.write_table(path, table)
                manifest.chunks.append({"name": path.name, "task_ids": [f"r{rank}-t{first + i}" for i in range(n)]})
            manifest.samples = tasks_per_rank * group_size
            publish_done(layout.rollout_done("train", iteration, rank), manifest, run_id=run_id, generation=1)
        t0, c0 = time.perf_counter(), time.process_time()
        stats = aggregate(layout, "train", iteration, ranks={r: 1 for r in range(ranks)}, run_id=run_id,
                          group_size=group_size)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        t0 = time.perf_counter()
        aggregate(layout, "train", iteration, ranks={r: 1 for r in range(ranks)}, run_id=run_id, group_size=group_size)
        again = time.perf_counter() - t0
    # CPU seconds beside wall seconds: on a shared machine the wall time also measures the neighbours.
    return {"ranks": ranks, "samples": stats["samples"], "seconds": seconds, "cpu_seconds": cpu,
            "load_average": os.getloadavg()[0], "target_seconds": AGGREGATE_TARGET_S,
            "within_target": seconds <= AGGREGATE_TARGET_S, "idempotent_rerun_seconds": again}




def bench_transformers(model_dir: Path | None, *, prompts: int, n: int, max_new_tokens: int,
                       threads: int | None = None) -> dict[str, Any]:
    import torch  # the engine loads it only when it starts; --help stays instant

    with tempfile.TemporaryDirectory(prefix="baton-bench-model-") as tmp:
        model_dir = model_dir or write_tiny_model(Path(tmp) / "tiny")
        with TransformersEngine(threads=threads) as engine:
            engine.start(model_dir)
            ids = [engine.tokenizer(f"{i}+{i * 7 % 1000}=")["input_ids"] for i in range(prompts)]
            sampling = Sampling(max_new_tokens, temperature=1.0, seed=0, stop_at_eos=False)
            engine.generate(ids[:2], 1, Sampling(2, seed=0))  # warm-up
            t0 = time.perf_counter()
            out = engine.generate(ids, n, sampling)
            seconds = time.perf_counter() - t0
    samples = sum(len(g) for g in out)
    tokens = sum(len(s.token_ids) for g in out for s in g)
    return {"prompts": prompts, "n": n, "max_new_tokens": max_new_tokens, "threads": torch.get_num_threads(),
            "seconds": seconds,
            "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds}


def bench_vllm(python: str | None, model_dir: Path | None, *, prompts: int, n: int, max_new_tokens: int) -> dict:
    if not python:
        return {"skipped": "vLLM tier not installed"}
    with tempfile.TemporaryDirectory(prefix="baton-bench-vllm-") as tmp:
        model_dir = model_dir or write_tiny_model(Path(tmp) / "tiny")
        return measure_vllm(model_dir, python, prompts=prompts, n=n, max_new_tokens=max_new_tokens)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of a table")
@click.option("--model-dir", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="model for the engine benchmarks (default: a fresh tiny model)")
@click.option("--vllm-python", envvar="BATON_VLLM_PYTHON", help="Python of the vLLM-on-CPU venv (env BATON_VLLM_PYTHON)")
@click.option("--prompts", default=64, show_default=True, help="prompts per engine call")
@click.option("--n", default=8, show_default=True, help="samples per prompt")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--threads", type=int, help="torch threads of the transformers engine (default: torch's choice; 1 with --env)")
@click.option("--ranks", default=8, show_default=True, help="ranks in the aggregation benchmark")
@click.option("--samples-per-rank", default=100_000, show_default=True)
@click.option("--env", "env", is_flag=True, help="instead: 64 environment episodes of 5 turns x 8 tokens, 200 ms "
                                                 "steps, at concurrency 1 and 32 (bench/env_speed.py)")
def main(as_json: bool, model_dir: Path | None, vllm_python: str | None, prompts: int, n: int, max_new_tokens: int,
         threads: int | None, ranks: int, samples_per_rank: int, env: bool) -> None:
    """Measure aggregation and engine throughput, or with --env environment episodes."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    log.setup("bench")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if env:
        report = run_env_bench(model_dir, threads=threads or 1)
        if as_json:
            click.echo(json.dumps(report, indent=1))
            return
        table = Table(title="environment episodes (64 x 5 turns x 8 tokens, 200 ms steps)")
        for col in ("concurrency", "wall s", "episodes/s", "engine busy s", "engine calls"):
            table.add_column(col)
        for c in report["wall_s"]:
            table.add_row(c, f"{report['wall_s'][c]:.2f}", f"{report['episodes_per_s'][c]:.2f}",
                          f"{report['generation_busy_s'][c]:.2f}", str(report["engine_calls"][c]))
        for target, met in report["targets"].items():
            table.add_row(target, "met" if met else "MISSED", "", "", "")
        Console().print(table)
        return
    results = {
        "aggregate": bench_aggregate(ranks, samples_per_rank),
        "transformers": bench_transformers(model_dir, prompts=prompts, n=n, max_new_tokens=max_new_tokens,
                                           threads=threads),
        "vllm": bench_vllm(vllm_python, model_dir, prompts=prompts, n=n, max_new_tokens=max_new_tokens),
    }
    if as_json:
        click.echo(json.dumps(results, indent=1))
        return
    table = Table(title="rollout benchmarks")
    for col in ("benchmark", "result", "target"):
        table.add_column(col)
    agg = results["aggregate"]
    table.add_row(f"aggregate {agg['ranks']} ranks x {samples_per_rank:,} samples",
                  f"{agg['seconds']:.2f} s ({agg['cpu_seconds']:.2f} s CPU, load {agg['load_average']:.1f})",
                  f"<= {AGGREGATE_TARGET_S:.0f} s ({'met' if agg['within_target'] else 'MISSED'})")
    table.add_row("aggregate again (idempotent)", f"{agg['idempotent_rerun_seconds']:.3f} s", "")
    for name in ("transformers", "vllm"):
        r = results[name]
        if "skipped" in r:
            table.add_row(f"{name} engine", r["skipped"], "")
        else:
            threads_note = f", {r['threads']} threads" if "threads" in r else ""
            table.add_row(f"{name} engine {prompts} prompts x {n} x {max_new_tokens} tokens{threads_note}",
                          f"{r['samples_per_s']:,.0f} samples/s, {r['tokens_per_s']:,.0f} tokens/s", "")
    Console().print(table)


if __name__ == "__main__":
    main()
