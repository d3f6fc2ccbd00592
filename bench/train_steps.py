"""`python -m bench --what train [--json]`: training throughput of the tiny model on CPU.
`--levers` (`--what levers`): the memory/speed levers against plain (bench/levers.py).
`--load-publish` (`--what load-publish`): load memory and publication time of a ~200M model,
the full-copy path against the sharded one, on 1 and 2 processes (bench/load_publish.py).
`--iteration` (`--what iteration`): whole RL iterations, resident trainer against restarts (bench/iteration.py).

For DDP and FSDP2 on 1 and 2 processes it writes synthetic trajectories, prepares a plan with
two optimizer steps, launches the real trainer under torchrun and reads the trainer's own step
metrics: tokens/s of the second (warm) step and the highest peak memory of any rank (peak RSS on
CPU, peak allocated memory on CUDA). Each process gets one OMP thread by default (--threads):
on a small or shared machine, OpenMP threads that spin-wait for a busy core make a step many
times slower, which would measure the neighbours rather than the trainer.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from bench.iteration import run_iteration_bench
from bench.levers import print_levers, run_levers
from coordination.layout import RunLayout
from coordination.net import free_port
from coordination.records import create_record, ensure_dir, read_record, restrict_umask
from rollout import store
from train.config import TrainConfig
from train.data import prepare_training_data
from train.launch import torchrun_command, torchrun_env
from train.tiny import write_tiny_model

REPO = Path(__file__).resolve().parents[1]


def _trajectories(layout, tokenizer_size: int, prompts: int, samples: int, completion_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for t in range(prompts):
        prompt = [1] + [rng.randrange(4, tokenizer_size) for _ in range(rng.randrange(6, 12))]
        for s in range(samples):
            completion = [rng.randrange(4, tokenizer_size) for _ in range(completion_tokens - 1)] + [2]
            rows.append({"task_id": f"t{t}", "sample_index": s, "prompt": "", "prompt_ids": prompt,
                         "completion_ids": completion, "logprobs": [-4.6] * completion_tokens, "text": "",
                         "reward": float(rng.random() < 0.5), "finish_reason": "stop", "policy_iteration": 0,
                         "iteration": 1, "split": "train", "rank": 0, "generation": 1,
                         **store.one_turn(completion_tokens)})
    store.write_rows(layout.rollout_all("train", 1), rows, run_id="bench")


def _run_case(root: Path, model: Path, backend: str, procs: int, opts: dict) -> dict:
    layout = RunLayout(root / f"{backend}-{procs}")
    # The trainer trains only on a plan of the run its folder names, so the folder gets a run.json.
    ensure_dir(layout.root)
    create_record(layout.run_json, "run", {"created_by": "bench"}, run_id="bench", generation=0)
    _trajectories(layout, 100, opts["prompts"], opts["samples"], opts["completion_tokens"], seed=0)
    cfg = TrainConfig(backend=backend, steps_per_iteration=2, micro_batch_tokens=opts["micro_batch_tokens"])
    plan = prepare_training_data(layout, 1, cfg, run_id="bench", world_size=procs, temperature=1.0,
                                 input_checkpoint=model, input_iteration=0)
    port = free_port("127.0.0.1")
    cmd = torchrun_command(python=sys.executable, nnodes=1, node_rank=0, nproc_per_node=procs,
                           rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"bench-{port}", is_host=True, local_addr=None,
                           module="train.trainer", args=["--plan", str(plan)])
    threads = opts["threads"] or max(1, (os.cpu_count() or 1) // procs)
    env = torchrun_env(dict(os.environ, PYTHONPATH=str(REPO)), omp_threads=threads, socket_ifname=None)
    log = root / f"{backend}-{procs}.log"
    started = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(opts["timeout"])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    wall = time.monotonic() - started
    if rc != 0:
        raise click.ClickException(f"{backend} on {procs} process(es) failed (exit {rc}); see {log}:\n"
                                   + log.read_text()[-3000:])
    results = [read_record(layout.training_result(1, 1, r)).data for r in range(procs)]
    warm = results[0]["steps"][-1]
    return {"backend": backend, "processes": procs, "threads_per_process": threads, "tokens_per_step": warm["tokens"],
            "step_seconds": round(warm["seconds"], 4), "tokens_per_s": round(warm["tokens_per_s"], 1),
            "peak_memory_mb": round(max(r["steps"][-1]["peak_memory_mb"] for r in results), 1),
            "launch_to_exit_s": round(wall, 1)}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="print one JSON document instead of a table")
@click.option("--levers", is_flag=True,
              help="instead: tokens/s and memory of plain, ac, ac_offloading, chunked logprobs, LoRA and compile "
                   "on a small Llama, as ratios to plain")
@click.option("--iteration", is_flag=True,
              help="instead: whole RL iterations through scripts/run.sh on one node, resident trainer against "
                   "train.resident=false (bench/iteration.py)")
@click.option("--iterations", default=3, show_default=True, help="--iteration: iterations per run")
@click.option("--train-steps", default=4, show_default=True, help="--iteration: optimizer steps per iteration")
@click.option("--repeats", default=3, show_default=True, help="--iteration: runs per mode (modes alternate)")
@click.option("--load-publish", is_flag=True,
              help="instead: peak RSS of loading and seconds of publishing a ~200M model, today's full-copy path "
                   "vs the sharded one, on 1 and 2 processes")
@click.option("--hidden", default=512, show_default=True, help="--levers: hidden size of the small Llama")
@click.option("--layers", default=8, show_default=True, help="--levers: decoder blocks")
@click.option("--vocab", default=32000, show_default=True, help="--levers: vocabulary size")
@click.option("--seq-len", default=1024, show_default=True, help="--levers: tokens per sequence")
@click.option("--batch-size", default=1, show_default=True, help="--levers: sequences per step")
@click.option("--cp-seq-len", default=8192, show_default=True,
              help="--levers: tokens per sequence of the cp row (context parallelism on 2 processes); 0 = no cp row")
@click.option("--warmup-steps", default=1, show_default=True, help="--levers: warm-up steps (include compilation)")
@click.option("--steps", default=3, show_default=True, help="--levers: measured steps")
@click.option("--prompts", default=64, show_default=True, help="groups in the synthetic iteration")
@click.option("--samples", default=8, show_default=True, help="samples per group")
@click.option("--completion-tokens", default=12, show_default=True)
@click.option("--micro-batch-tokens", default=2048, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True,
              help="OMP threads per process; 0 = split the cores evenly between the processes")
@click.option("--timeout", default=600.0, show_default=True, help="seconds allowed per torchrun launch")
def main(as_json: bool, levers: bool, iteration: bool, load_publish: bool, **opts) -> None:
    """Tokens/s of one training step for DDP and FSDP2 on 1 and 2 processes (tiny model, CPU),
    or with --levers each memory/speed lever against plain."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    if iteration:
        opts["threads"] = opts["threads"] or 1
        with tempfile.TemporaryDirectory(prefix="baton-iteration-bench-") as tmp:
            report = run_iteration_bench({**opts, "steps": opts["train_steps"]}, Path(tmp),
                                         echo=lambda text: click.echo(text, err=True))
        if as_json:
            click.echo(json.dumps(report, indent=1))
        else:
            click.echo(f"resident {report['resident_wall_s']:.1f} s vs restart {report['restart_wall_s']:.1f} s "
                       f"(ratio {report['ratio']:.2f}); phase 10 median {report['phase10_median_s']['resident']:.2f} s "
                       f"vs {report['phase10_median_s']['restart']:.2f} s")
        return
    if load_publish:
        from bench.load_publish import run_load_publish  # imports torch, which the other benchmarks leave to their children

        with tempfile.TemporaryDirectory(prefix="baton-load-publish-") as tmp:
            report = run_load_publish(Path(tmp), timeout=opts["timeout"],
                                      echo=lambda text: None if as_json else click.echo(text, err=True))
        if as_json:
            click.echo(json.dumps(report, indent=1))
            return
        click.echo(f"{report['model']}: {report['model_fp32_mb']:,.0f} MB in float32; a rank's RSS before loading "
                   f"{report['baseline_rss_mb']:,.0f} MB")
        for mode in ("current", "sharded"):
            r = report[mode]
            click.echo(f"{mode:8} load peak RSS {r['load_peak_rss_mb_world1']:>8,.0f} MB (1 proc) "
                       f"{r['load_peak_rss_mb_world2']:>8,.0f} MB (2 procs); publish {r['publish_s_world1']:.2f} s "
                       f"(1 proc) {r['publish_s_world2']:.2f} s (2 procs)")
        sizes = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in report["checkpoint_bytes"].items())
        click.echo(f"checkpoint on 2 procs: {sizes}; writing the float32 state {report['fp32_state_write_s_world2']:.2f} s, "
                   f"AdamW's moments {report['optimizer_write_s_world2']:.2f} s (the background write)")
        click.echo(f"sharded, 2 procs: (peak - baseline) / fp32 size = "
                   f"{report['sharded_load_over_baseline_ratio_world2']:.2f} (target <= 0.6)")
        return
    if levers:
        opts["threads"] = opts["threads"] or 1
        with tempfile.TemporaryDirectory(prefix="baton-train-levers-") as tmp:
            report = run_levers(opts, Path(tmp), echo=lambda text: click.echo(text, err=True))
        if as_json:
            click.echo(json.dumps(report, indent=1))
        else:
            print_levers(report)
        return

    cases = [("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="baton-train-bench-") as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "tiny")
        params = json.loads((Path(model) / "baton-tiny.json").read_text())["parameters"]
        for backend, procs in cases:
            rows.append(_run_case(root, model, backend, procs, opts))
            if not as_json:
                click.echo(f"{backend} x{procs}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", err=True)
    report = {"model": f"train.tiny default ({params:,} parameters)", "device": "cpu", "cpus": os.cpu_count(),
              "results": rows}
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    table = Table(title=f"train.bench: one GRPO step of the {report['model']} on CPU ({os.cpu_count()} cores)")
    for col in ("backend", "processes", "threads/proc", "tokens/step", "step s", "tokens/s", "peak MB", "launch s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["backend"], str(r["processes"]), str(r["threads_per_process"]), str(r["tokens_per_step"]),
                      f"{r['step_seconds']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['peak_memory_mb']:,.0f}",
                      f"{r['launch_to_exit_s']:.1f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
