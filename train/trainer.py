"""Phase 10-11: `torchrun ... -m train.trainer --plan PLAN --attempt A` (or plain `python -m` for one process).

`python -m train.trainer --bench [train key=value ...]` benchmarks a training step on fake data
instead (train/benchmark.py), with any levers set by the overrides, e.g. `ac.freq=1 lora.rank=8`.

Every rank reads the plan, its own shard, the input checkpoint the plan pins and, when present,
its optimizer state; trains the plan's steps; writes its optimizer shard and a result record.
When all ranks agree that everything is written, rank 0 writes the Hugging Face folder and the
completeness marker into the attempt's staging folder and publishes it as checkpoints/iter-N.
If any rank fails, every rank exits non-zero and nothing is published. If iter-N is already
published, the trainer exits 0 at once (a rerun never trains twice).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from train.benchmark import bench_options

_log = logging.getLogger("baton.train.trainer")


def _seed(seed: int, iteration: int) -> int:
    return (int(seed) * 1_000_003 + int(iteration)) % (2**63)


def _load(plan: dict[str, Any], cfg, layout, iteration: int, info):
    """Every rank loads its shard, the input checkpoint and its optimizer state, then applies the
    levers and the parallelism. Returns (shard, trainable, reference, optimizer step, pad id)."""
    import torch

    from train.batches import read_shard
    from train.build import load_model, make_reference, make_trainable, preflight
    from train.distributed import agreed
    from train.export import read_trainer_state
    from train.model import load_causal_lm
    from train.optim_state import load_optimizer_state

    agreed("checking the trainer settings", info, lambda: preflight(cfg, info))
    torch.manual_seed(_seed(plan["seed"], iteration))
    source = Path(plan["input_checkpoint"])
    use_ref = cfg.kl_coef > 0 and bool(plan["steps"])

    def load_inputs():
        shard = {}
        if plan["steps"]:
            entry = plan["shards"][info.rank]
            shard = read_shard(layout.training_dir(iteration) / entry["file"], entry["sha256"])
        ref = load_causal_lm(Path(plan["reference_model"]), cfg.attn) if use_ref else None
        state = read_trainer_state(source)
        return shard, load_model(cfg, source, state), state, ref

    shard, loaded, state, ref_lm = agreed("loading the training shard and the input checkpoint", info, load_inputs)
    t = make_trainable(loaded, cfg, info)
    reference = make_reference(ref_lm, cfg, info, t.dtype) if ref_lm is not None else None
    resumed = state is not None and bool(state.get("has_optimizer_state")) and t.weights.resume_optimizer
    if resumed:
        load_optimizer_state(source, t.optimizer, t.policy)  # collective (DCP); resharded to this world size
        if t.optimizer_offload is not None:
            t.optimizer_offload.to_host()
    opt_step = int(state["optimizer_step"]) if resumed else 0
    _log.info("rank %d/%d on %s (%s, %s): %d steps from %s (iteration %d, optimizer step %d%s)", info.rank,
              info.world_size, info.device, cfg.backend, str(t.dtype).removeprefix("torch."), len(plan["steps"]),
              source, plan["input_iteration"], opt_step, "" if resumed else ", fresh optimizer")
    pad_id = loaded.lm.config.pad_token_id if loaded.lm.config.pad_token_id is not None else 0
    return shard, t, reference, opt_step, pad_id


def train(plan: dict[str, Any], layout, iteration: int, attempt: int, info) -> None:
    from coordination.config import from_dict
    from train.batches import collate
    from train.checkpoint import publish_checkpoint
    from train.config import TrainConfig
    from train.distributed import agreed
    from train.export import prepare_output_dir, save_checkpoint
    from train.optim import config_lr
    from train.results import summarise, write_result
    from train.step import StepSettings, train_step

    started = time.monotonic()
    cfg = from_dict(TrainConfig, plan["config"])
    steps, run_id = plan["steps"], plan["run_id"]
    staging = layout.checkpoint_staging(iteration, attempt)
    shard, t, reference, opt_step, pad_id = _load(plan, cfg, layout, iteration, info)
    if not steps:
        _log.info("the plan has no steps (%s): republishing the input weights as iteration %d",
                  plan.get("zero_steps_reason"), iteration)
    agreed("preparing the staging folder", info, lambda: prepare_output_dir(staging, info))
    settings = StepSettings(algorithm=cfg.algorithm, backend=cfg.backend, dtype=t.dtype,
                            temperature=plan["temperature"] if plan["temperature"] > 0 else 1.0,
                            clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef,
                            grad_clip=cfg.grad_clip)
    t.model.train()
    history = []
    for s, step in enumerate(steps):
        micro_batches = [collate(shard.get((s, m), []), pad_id) for m in range(step["micro_batches_per_rank"])]
        metrics = train_step(t.model, t.params, t.optimizer, micro_batches, lr=config_lr(cfg, opt_step),
                             global_completion_tokens=step["completion_tokens"], settings=settings, info=info,
                             reference=reference)
        opt_step += 1
        history.append(metrics.as_dict())
        if info.is_main:
            _log.info(metrics.line(f"iter {iteration} step {s + 1}/{len(steps)} (optimizer step {opt_step})"))

    write_result(layout, iteration, attempt, info.rank, run_id,
                 {"ok": True, "world_size": info.world_size, "steps": history, "optimizer_step": opt_step,
                  "summary": summarise(history, plan, time.monotonic() - started)})
    source = Path(plan["input_checkpoint"])
    save_checkpoint(staging, policy=t.policy, optimizer=t.optimizer, info=info, backend=cfg.backend, run_id=run_id,
                    iteration=iteration, tokenizer_source=source,
                    trainer_state={"optimizer_step": opt_step, "iteration": iteration, "algorithm": cfg.algorithm,
                                   "input_checkpoint": str(source), "input_iteration": plan["input_iteration"]},
                    lora=cfg.lora, lora_record=t.weights.record)
    final = agreed("publishing the checkpoint", info,
                   lambda: publish_checkpoint(layout, iteration, staging, run_id=run_id) if info.is_main else None)
    if info.is_main:
        _log.info("published %s (optimizer step %d) in %.1f s", final, opt_step, time.monotonic() - started)


def run(plan_path: Path, attempt: int) -> int:
    """The trainer's whole life on one rank; returns the process exit code."""
    from coordination import log
    from coordination.layout import RunLayout
    from coordination.records import read_record
    from train.checkpoint import is_complete, publish_checkpoint
    from train.data import read_plan
    from train.distributed import init_distributed, launched_world_size, offloads_to_cpu, shutdown
    from train.results import write_result

    rank = int(os.environ.get("RANK", "0"))
    log.setup(f"train rank{rank}")
    try:
        layout, iteration = RunLayout.from_training_plan(plan_path)
        # The plan must be this run's: a training folder copied from another run would train
        # (and publish) on its data under this run's name.
        plan = read_plan(plan_path, run_id=read_record(layout.run_json, kind="run").run_id)
    except Exception as exc:  # noqa: BLE001 -- reported as the reason for the exit code
        _log.error("cannot read the training plan %s: %s", plan_path, exc)
        return 2
    world = launched_world_size()
    if world != plan["world_size"]:
        _log.error("the plan %s was made for %d trainer processes but %d were launched; launch nnodes x "
                   "nproc_per_node = %d processes, or prepare the data again for %d", plan_path,
                   plan["world_size"], world, plan["world_size"], world)
        return 2
    if is_complete(layout.checkpoint(iteration), run_id=plan["run_id"]):
        if rank == 0:
            publish_checkpoint(layout, iteration, layout.checkpoint_staging(iteration, attempt), run_id=plan["run_id"])
        _log.info("iteration %d is already published at %s; nothing to train", iteration, layout.checkpoint(iteration))
        return 0
    info = None
    try:
        info = init_distributed(float(plan["config"]["collective_timeout"]),
                                cpu_offload=offloads_to_cpu(plan["config"]))
        train(plan, layout, iteration, attempt, info)
        return 0
    except Exception as exc:  # noqa: BLE001 -- every failure becomes a non-zero exit and a result record
        from coordination.config import ConfigError
        from train.batches import ShardError
        from train.checkpoint import CheckpointError
        from train.distributed import PeerFailed
        from train.step import TrainingDiverged

        explained = isinstance(exc, (ShardError, CheckpointError, PeerFailed, TrainingDiverged, FileNotFoundError,
                                     ConfigError))
        _log.error("training iteration %d attempt %d failed on rank %d: %s", iteration, attempt, rank, exc,
                   exc_info=not explained)
        try:
            write_result(layout, iteration, attempt, rank, plan["run_id"],
                         {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        return 1
    finally:
        if info is not None:
            shutdown()


def run_bench(opts: dict, config_files: tuple[Path, ...], overrides: tuple[str, ...]) -> int:
    """`--bench`: the RL (GRPO) step on fake data; exit 2 on a configuration to fix."""
    from coordination import log
    from coordination.config import ConfigError
    from train.benchmark import bench_model, print_and_write, run_bench as bench, train_config_from
    from train.distributed import init_distributed, offloads_to_cpu, shutdown

    log.setup(f"bench rank{os.environ.get('RANK', '0')}")
    info = None
    try:
        cfg = train_config_from({}, config_files, overrides)
        with bench_model(opts["model"], opts["bench_seq_len"]) as model_path:
            info = init_distributed(cfg.collective_timeout, cpu_offload=offloads_to_cpu(cfg))
            report = bench(cfg, {**opts, "model_path": model_path}, info, entry="trainer",
                           algorithm="grpo" if cfg.algorithm == "grpo" else "rft")
    except ConfigError as exc:
        _log.error("%s", exc)
        return 2
    finally:
        if info is not None:
            shutdown()
    if info.is_main:
        print_and_write(report, opts["bench_output_json"])
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), default=None,
              help="training/iter-N/plan.json written by phase 8 (train.data.prepare_training_data)")
@click.option("--attempt", type=int, default=1, show_default=True,
              help="attempt number; each attempt stages its checkpoint in its own folder")
@click.option("--model", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="--bench: Hugging Face folder to benchmark (default: a tiny model written on the fly)")
@click.option("--config", "config_files", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              multiple=True, help="--bench: YAML file(s) whose `train` section sets the levers")
@bench_options
@click.argument("overrides", nargs=-1)
def main(plan_path: Path | None, attempt: int, model: Path | None, config_files: tuple[Path, ...],
         overrides: tuple[str, ...], **bench) -> None:
    """Train one iteration from its plan and publish checkpoints/iter-N (run under torchrun).

    With --bench: benchmark training steps on fake data; OVERRIDES are train config keys
    (key=value, e.g. ac.freq=1 fused_lm_head_token_chunk_size=disabled lora.rank=8)."""
    from coordination.records import restrict_umask

    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    if bench["bench"]:
        if plan_path is not None:
            raise click.UsageError("--bench trains on fake data and takes no --plan")
        _exit(run_bench({**bench, "model": model}, config_files, overrides))
    if plan_path is None:
        raise click.UsageError("give --plan PLAN (the training plan of phase 8), or --bench to benchmark")
    if overrides or config_files or model is not None:
        raise click.UsageError("--model, --config and key=value overrides are for --bench; a training run takes its "
                               "config from the plan")
    _exit(run(plan_path, attempt))


def _exit(code: int) -> None:
    """Leave without the interpreter's finalization. By now the results and the checkpoint are
    published (fsync, then rename) and the process group is destroyed, but torch's gloo threads
    can still abort finalization ("terminate called without an active exception", SIGABRT; seen
    on a 2-process CPU run right after its checkpoint was published), which turned a finished
    attempt into a failed one. Logs and standard streams are flushed first."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
