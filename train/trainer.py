"""Phase 10-11: `torchrun ... -m train.trainer --plan PLAN --attempt A` (or plain `python -m` for one process).

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

_log = logging.getLogger("baton.train.trainer")


def _seed(seed: int, iteration: int) -> int:
    return (int(seed) * 1_000_003 + int(iteration)) % (2**63)


def _load(plan: dict[str, Any], cfg, layout, iteration: int, info):
    """Every rank loads its shard, the input checkpoint and its optimizer state, then parallelises.
    Returns (shard, policy, model, optimizer, reference, optimizer step, pad id, compute dtype)."""
    import torch

    from train.batches import read_shard
    from train.distributed import agreed
    from train.export import read_trainer_state
    from train.model import Policy, compute_dtype, load_causal_lm, named_master_params
    from train.optim import build_optimizer
    from train.optim_state import load_optimizer_state
    from train.parallel import apply_parallelism

    torch.manual_seed(_seed(plan["seed"], iteration))
    source = Path(plan["input_checkpoint"])
    use_ref = cfg.kl_coef > 0 and bool(plan["steps"])

    def load_inputs():
        shard = {}
        if plan["steps"]:
            entry = plan["shards"][info.rank]
            shard = read_shard(layout.training_dir(iteration) / entry["file"], entry["sha256"])
        ref = load_causal_lm(Path(plan["reference_model"])) if use_ref else None
        return shard, load_causal_lm(source), read_trainer_state(source), ref

    shard, lm, state, ref_lm = agreed("loading the training shard and the input checkpoint", info, load_inputs)
    dtype = compute_dtype(cfg.dtype, info.device)
    policy = Policy(lm)
    model = apply_parallelism(policy, cfg.backend, info, dtype)
    reference = None
    if ref_lm is not None:
        ref_lm.requires_grad_(False)
        reference = apply_parallelism(Policy(ref_lm), cfg.backend, info, dtype).eval()
    optimizer = build_optimizer(policy.parameters(), cfg)
    resumed = state is not None and bool(state.get("has_optimizer_state"))
    if resumed:
        agreed("loading optimizer state", info, lambda: load_optimizer_state(
            source, optimizer, named_master_params(policy), saved_world_size=int(state["world_size"])))
    opt_step = int(state["optimizer_step"]) if resumed else 0
    _log.info("rank %d/%d on %s (%s, %s): %d steps from %s (iteration %d, optimizer step %d%s)", info.rank,
              info.world_size, info.device, cfg.backend, str(dtype).removeprefix("torch."), len(plan["steps"]),
              source, plan["input_iteration"], opt_step, "" if resumed else ", fresh optimizer")
    pad_id = lm.config.pad_token_id if lm.config.pad_token_id is not None else 0
    return shard, policy, model, optimizer, reference, opt_step, pad_id, dtype


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
    shard, policy, model, optimizer, reference, opt_step, pad_id, dtype = _load(plan, cfg, layout, iteration, info)
    if not steps:
        _log.info("the plan has no steps (%s): republishing the input weights as iteration %d",
                  plan.get("zero_steps_reason"), iteration)
    agreed("preparing the staging folder", info, lambda: prepare_output_dir(staging, info))
    settings = StepSettings(algorithm=cfg.algorithm, backend=cfg.backend, dtype=dtype,
                            temperature=plan["temperature"] if plan["temperature"] > 0 else 1.0,
                            clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef,
                            grad_clip=cfg.grad_clip)
    params = list(policy.parameters())
    model.train()
    history = []
    for s, step in enumerate(steps):
        micro_batches = [collate(shard.get((s, m), []), pad_id) for m in range(step["micro_batches_per_rank"])]
        metrics = train_step(model, params, optimizer, micro_batches, lr=config_lr(cfg, opt_step),
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
    save_checkpoint(staging, policy=policy, optimizer=optimizer, info=info, backend=cfg.backend, run_id=run_id,
                    iteration=iteration, tokenizer_source=source,
                    trainer_state={"optimizer_step": opt_step, "iteration": iteration, "algorithm": cfg.algorithm,
                                   "input_checkpoint": str(source), "input_iteration": plan["input_iteration"]})
    final = agreed("publishing the checkpoint", info,
                   lambda: publish_checkpoint(layout, iteration, staging, run_id=run_id) if info.is_main else None)
    if info.is_main:
        _log.info("published %s (optimizer step %d) in %.1f s", final, opt_step, time.monotonic() - started)


def run(plan_path: Path, attempt: int) -> int:
    """The trainer's whole life on one rank; returns the process exit code."""
    from coordination import log
    from coordination.layout import RunLayout
    from train.checkpoint import is_complete, publish_checkpoint
    from train.data import read_plan
    from train.distributed import init_distributed, launched_world_size, shutdown
    from train.results import write_result

    rank = int(os.environ.get("RANK", "0"))
    log.setup(f"train rank{rank}")
    try:
        layout, iteration = RunLayout.from_training_plan(plan_path)
        plan = read_plan(plan_path)
    except Exception as exc:  # noqa: BLE001 -- reported as the reason for the exit code
        _log.error("cannot read the training plan %s: %s", plan_path, exc)
        return 2
    world = launched_world_size()
    if world != plan["world_size"]:
        _log.error("the plan %s was made for %d trainer processes but %d were launched; launch nnodes x "
                   "nproc_per_node = %d processes, or prepare the data again for %d", plan_path,
                   plan["world_size"], world, plan["world_size"], world)
        return 2
    if is_complete(layout.checkpoint(iteration)):
        if rank == 0:
            publish_checkpoint(layout, iteration, layout.checkpoint_staging(iteration, attempt), run_id=plan["run_id"])
        _log.info("iteration %d is already published at %s; nothing to train", iteration, layout.checkpoint(iteration))
        return 0
    info = None
    try:
        info = init_distributed(float(plan["config"]["collective_timeout"]))
        train(plan, layout, iteration, attempt, info)
        return 0
    except Exception as exc:  # noqa: BLE001 -- every failure becomes a non-zero exit and a result record
        from train.batches import ShardError
        from train.checkpoint import CheckpointError
        from train.distributed import PeerFailed
        from train.step import TrainingDiverged

        explained = isinstance(exc, (ShardError, CheckpointError, PeerFailed, TrainingDiverged, FileNotFoundError))
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


@click.command()
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), required=True,
              help="training/iter-N/plan.json written by phase 8 (train.data.prepare_training_data)")
@click.option("--attempt", type=int, default=1, show_default=True,
              help="attempt number; each attempt stages its checkpoint in its own folder")
def main(plan_path: Path, attempt: int) -> None:
    """Train one iteration from its plan and publish checkpoints/iter-N (run under torchrun)."""
    sys.exit(run(plan_path, attempt))


if __name__ == "__main__":
    main()
