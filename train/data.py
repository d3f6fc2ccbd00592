"""Phase 8: an iteration's trajectories -> per-rank training shards and the training plan.

The master reads `rollouts/train/iter-N/all.parquet` (through rollout.store), computes GRPO
advantages (or selects successful samples for rft), shuffles the kept samples with a seed
derived from (train.seed, iteration), cuts them into `steps_per_iteration` optimizer steps (over
`epochs` passes, each reshuffled), packs
each step into micro-batches under `micro_batch_tokens` and deals those to the trainer ranks.
Each rank's micro-batches go to its own Parquet shard, so a rank reads only its share.

The plan (`training/iter-N/plan.json`, a "training-plan" record) pins everything the trainer
needs, above all the input checkpoint: the trainer trains from it, not from whatever LATEST is
when it starts, so a rerun after a crash uses the same inputs and never trains twice.

If every group has zero advantage the plan has zero steps; the trainer then republishes the
input weights (and optimizer state) unchanged as iter-N, so the run still advances.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from coordination.config import to_dict
from coordination.layout import RunLayout
from coordination.records import NotThereYet, WrongRun, publish_record, read_record
from rollout import store
from rollout.episodes import FAILED
from rollout.rewards import TIMED_OUT
from train.advantages import Selection, grpo_selection, rft_selection
from train.batches import sha256_of, write_shard
from train.config import TrainConfig, check_world_size
from train.context_rules import check_cp_world
from train.packing import pack_step, split_steps

_log = logging.getLogger("baton.train.data")

PLAN_KIND = "training-plan"
_COLUMNS = ["task_id", "sample_index", "prompt_ids", "completion_ids", "logprobs", "loss_mask", "reward",
            "finish_reason", "termination"]


class TrainingDataError(ValueError):
    """Trajectories that cannot be turned into training data; the message names the file and the fix."""


def data_seed(seed: int, iteration: int) -> list[int]:
    """numpy SeedSequence entropy for an iteration: independent of world size and attempt."""
    return [int(seed), int(iteration)]


def select(rows: dict[str, list], cfg: TrainConfig) -> Selection:
    if cfg.algorithm == "grpo":
        return grpo_selection(rows["task_id"], rows["reward"], std_normalize=cfg.advantage_std_normalize,
                              std_eps=cfg.std_eps)
    return rft_selection(rows["task_id"], rows["reward"], min_reward=cfg.rft_min_reward)


def _existing_plan(layout: RunLayout, iteration: int, run_id: str) -> dict[str, Any] | None:
    try:
        return read_record(layout.training_plan(iteration), kind=PLAN_KIND, run_id=run_id).data
    except (NotThereYet, WrongRun):
        return None


def plan_is_usable(layout: RunLayout, plan: dict[str, Any], *, world_size: int, cfg: TrainConfig) -> bool:
    """A plan is reused when it was made for this world size and config and its shards are intact."""
    if plan.get("world_size") != world_size or plan.get("config") != to_dict(cfg):
        return False
    for shard in plan.get("shards", []):
        path = layout.training_dir(plan["iteration"]) / shard["file"]
        try:
            if sha256_of(path) != shard["sha256"]:
                return False
        except FileNotFoundError:
            return False
    return True


def _read_trajectories(path: Path, iteration: int, run_id: str) -> dict[str, list]:
    try:
        table = store.read_table(path, columns=_COLUMNS, run_id=run_id)
    except store.TrajectoryFileError as exc:
        raise TrainingDataError(f"{exc}; phase 3 (aggregate train rollouts) of iteration {iteration} must "
                                f"finish before training data can be prepared") from None
    rows = table.to_pydict()
    for i, (ids, lps, mask) in enumerate(zip(rows["completion_ids"], rows["logprobs"], rows["loss_mask"])):
        if not len(ids) == len(lps) == len(mask):
            raise TrainingDataError(f"{path}: row {i} (task {rows['task_id'][i]}) has {len(ids)} completion tokens "
                                    f"but {len(lps)} logprobs and {len(mask)} loss mask entries; the rollout that "
                                    f"wrote it is broken")
    return rows


def _plan_steps(rows: dict[str, list], kept: list[tuple[int, float]], cfg: TrainConfig, world_size: int,
                seed: list[int]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Shuffle, cut into optimizer steps, pack each step for the ranks: (steps, shard rows per rank).
    Under context parallelism a step is packed for world_size / cp data ranks and the cp ranks of
    a group get the same rows (each trains on its own slice of their positions, train/context.py)."""
    rng = np.random.default_rng(seed)
    parts: list[list[tuple[int, float]]] = []
    for _ in range(cfg.epochs if kept else 0):
        # Each pass reshuffles and cuts the samples into steps_per_iteration / epochs mini-batches.
        parts.extend(split_steps([kept[j] for j in rng.permutation(len(kept))], cfg.steps_per_iteration // cfg.epochs))
    shard_rows: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    steps = []
    for step, part in enumerate(parts):
        lengths = [len(rows["prompt_ids"][i]) + len(rows["completion_ids"][i]) for i, _ in part]
        advantage = dict(part)
        pack = pack_step([i for i, _ in part], lengths, budget=cfg.micro_batch_tokens, world_size=world_size // cfg.cp)
        for rank in range(world_size):
            for m, members in enumerate(pack.ranks[rank // cfg.cp]):
                shard_rows[rank].extend({
                    "step": step, "micro_batch": m, "task_id": rows["task_id"][i],
                    "sample_index": rows["sample_index"][i], "prompt_ids": rows["prompt_ids"][i],
                    "completion_ids": rows["completion_ids"][i], "logprobs": rows["logprobs"][i],
                    "loss_mask": rows["loss_mask"][i], "advantage": advantage[i]} for i in members)
        # The loss is normalised by the policy's tokens only: environment tokens are context.
        steps.append({"samples": len(part), "completion_tokens": sum(sum(rows["loss_mask"][i]) for i, _ in part),
                      "tokens": sum(lengths), "micro_batches_per_rank": pack.micro_batches_per_rank})
    return steps, shard_rows


def model_inputs(cfg: TrainConfig, *, iteration: int, world_size: int, input_checkpoint: Path, input_iteration: int,
                 reference_model: Path | None = None) -> dict[str, Any]:
    """The part of an iteration's plan that says what the trainer loads (train.trainer.load_held):
    its input checkpoint, reference model, seed, world size and `train` config. A resident trainer
    launched early gets exactly this before the plan exists (docs/design.md §9.6), so what it
    loads is what the plan would have made it load."""
    return {"iteration": iteration, "input_checkpoint": str(input_checkpoint), "input_iteration": int(input_iteration),
            "reference_model": str(reference_model) if reference_model is not None else None,
            "world_size": world_size, "seed": cfg.seed, "config": to_dict(cfg)}


def prepare_training_data(layout: RunLayout, iteration: int, cfg: TrainConfig, *, run_id: str, world_size: int,
                          temperature: float, input_checkpoint: Path, input_iteration: int,
                          reference_model: Path | None = None, generation: int = 0) -> Path:
    """Write the shards and the plan of `iteration` for `world_size` trainer ranks; return the plan path.

    Idempotent: a usable plan of this run is returned as it is. A plan that exists for another
    world size or config, or whose shards were damaged, is rebuilt from the same trajectories,
    keeping the input checkpoint it pinned."""
    plan_path = layout.training_plan(iteration)
    old = _existing_plan(layout, iteration, run_id)
    if old is not None:
        if plan_is_usable(layout, old, world_size=world_size, cfg=cfg):
            return plan_path
        _log.info("rebuilding the training plan of iteration %d (world size, config or shards changed)", iteration)
        input_checkpoint, input_iteration = Path(old["input_checkpoint"]), int(old["input_iteration"])
        temperature = float(old["temperature"])
    if cfg.kl_coef > 0 and reference_model is None:
        raise TrainingDataError("train.kl_coef > 0 needs a reference model: pass reference_model (the base model)")
    if world_size < 1:
        raise TrainingDataError(f"world_size must be at least 1 (got {world_size})")
    if cfg.backend == "fsdp":
        check_world_size(cfg.dp_replicate, world_size)   # fail here, before every node launches torchrun
    check_cp_world(cfg.cp, world_size)

    source = layout.rollout_all("train", iteration)
    rows = _read_trajectories(source, iteration, run_id)
    selection = select(rows, cfg)
    # A sample without policy tokens has nothing to train on. A group with a sample whose reward
    # ran past tasks.reward_timeout, or whose environment failed (env_error, timeout), has no
    # honest advantages: its 0 is not a score.
    timed_out = {t for t, f in zip(rows["task_id"], rows["finish_reason"]) if f == TIMED_OUT}
    env_failed = {t for t, term in zip(rows["task_id"], rows["termination"]) if term in FAILED}
    kept = [(i, a) for i, a in zip(selection.indices, selection.advantages)
            if any(rows["loss_mask"][i]) and rows["task_id"][i] not in timed_out | env_failed]
    steps, shard_rows = _plan_steps(rows, kept, cfg, world_size, data_seed(cfg.seed, iteration))

    shards = []
    if steps:
        for rank in range(world_size):
            path = layout.training_shard(iteration, rank)
            digest = write_shard(path, shard_rows[rank])
            shards.append({"rank": rank, "file": path.name, "rows": len(shard_rows[rank]), "sha256": digest})

    rewards = np.asarray(rows["reward"], dtype=np.float64)
    plan = {
        "run_id": run_id, "algorithm": cfg.algorithm, "temperature": float(temperature),
        **model_inputs(cfg, iteration=iteration, world_size=world_size, input_checkpoint=input_checkpoint,
                       input_iteration=input_iteration, reference_model=reference_model),
        "steps": steps, "shards": shards,
        "zero_steps_reason": None if steps else (
            "every group has zero advantage (all samples of each task got the same reward)"
            if cfg.algorithm == "grpo" else f"no sample reached train.rft_min_reward={cfg.rft_min_reward}") + (
            f"; {len(timed_out)} groups left out for a reward that ran past tasks.reward_timeout"
            if timed_out else "") + (
            f"; {len(env_failed)} groups left out for an episode whose environment failed" if env_failed else ""),
        "stats": {"samples": len(rewards), "samples_kept": len(kept), "groups": selection.groups,
                  "groups_kept": selection.groups_kept, "zero_advantage_groups": selection.zero_advantage_groups,
                  "reward_timeout_groups": len(timed_out), "env_failed_groups": len(env_failed),
                  "mean_reward": float(rewards.mean()) if len(rewards) else 0.0,
                  "completion_tokens": sum(s["completion_tokens"] for s in steps)},
    }
    publish_record(plan_path, PLAN_KIND, plan, run_id=run_id, generation=generation)
    _log.info("training plan of iteration %d: %d samples kept of %d (%d/%d groups), %d steps, %d ranks%s",
              iteration, len(kept), len(rewards), selection.groups_kept, selection.groups, len(steps), world_size,
              "" if steps else f" -- {plan['zero_steps_reason']}; the input weights are republished unchanged")
    return plan_path


def read_plan(path: Path, run_id: str | None = None) -> dict[str, Any]:
    """The plan record's data (raises NotThereYet / WrongRun like every record reader)."""
    rec = read_record(path, kind=PLAN_KIND, run_id=run_id)
    return {**rec.data, "run_id": rec.run_id}
