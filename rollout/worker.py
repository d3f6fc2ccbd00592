"""The rollout worker: one rank's share of an iteration's tasks -> scored samples -> chunk files
-> DONE (docs/design.md §6 phases 1 and 5).

Resumable by construction. Chunks are immutable and named with the writer's generation, so a
restarted (or fenced) process never overwrites anything. On start the worker reads every chunk
already in its rank folder, whatever generation wrote it, keeps each task's first complete
group in (sequence, generation) order, and rolls out only the tasks still missing. A node that
dies mid-rollout therefore loses at most the groups of its last engine call and unflushed
buffer; nothing is duplicated because DONE names exactly which chunk each task is taken from.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import click

from coordination import log
from coordination.checkpoints import CheckpointError, serving_weights
from coordination.config import load
from coordination.layout import RunLayout
from coordination.progress import Progress
from coordination.records import NotThereYet, restrict_umask
from rollout import store
from rollout.chunks import (Manifest, RolloutError, complete_groups, completion_tokens, list_chunks,
                            publish_done, read_chunk, read_done, write_chunk)
from rollout.config import RolloutConfig
from rollout.engine import Engine, EngineError, Sample, Sampling
from rollout.engines.transformers_engine import TransformersEngine
from rollout.prompts import encode_prompt
from rollout.rewards import TIMED_OUT, RewardFn, RewardTimeout, load_reward
from rollout.split import parse_rank_weights, rank_slice, sample_iteration
from rollout.tasks import Task, load_tasks

_log = log.get("rollout")


@dataclass
class RolloutSummary:
    tasks: int
    samples: int
    completion_tokens: int
    seconds: float
    chunks: int
    resumed_tasks: int
    generated_samples: int = 0
    generated_tokens: int = 0


@dataclass
class Group:
    """One task's samples with their rewards."""

    task: Task
    prompt_ids: list[int]
    samples: list[Sample]
    rewards: list[float]


def sampling_for(cfg: RolloutConfig, split: str) -> tuple[Sampling, int]:
    """(Sampling, group size) of a split: training rollouts sample, eval rollouts use the eval settings."""
    if split == "eval":
        return Sampling(cfg.max_new_tokens, cfg.eval_temperature, 1.0, cfg.seed), cfg.eval_group_size
    return Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed), cfg.group_size


def call_seed(base: int | None, split: str, iteration: int, task_ids: Sequence[str]) -> int:
    """Seed of one engine call, from its content: the same tasks give the same samples on a rerun."""
    h = hashlib.sha256(f"{base}/{split}/{iteration}/".encode())
    for t in task_ids:
        h.update(t.encode() + b"\0")
    return int.from_bytes(h.digest()[:8], "little") >> 1


def roll_groups(engine: Engine, tokenizer: Any, tasks: Sequence[Task], group_size: int, sampling: Sampling,
                reward_fn: RewardFn) -> list[Group]:
    """Sample `group_size` completions of each task in one engine call and score every one."""
    prompt_ids = [encode_prompt(tokenizer, t) for t in tasks]
    results = engine.generate(prompt_ids, group_size, sampling)
    if len(results) != len(tasks):
        raise RolloutError(f"engine {engine.name} returned samples for {len(results)} of {len(tasks)} prompts; "
                           f"the engine is broken")
    return [_scored(engine, task, ids, samples, group_size, reward_fn)
            for task, ids, samples in zip(tasks, prompt_ids, results)]


def _scored(engine: Engine, task: Task, prompt_ids: list[int], samples: list[Sample], group_size: int,
            reward_fn: RewardFn) -> Group:
    if len(samples) != group_size:
        raise RolloutError(f"engine {engine.name} returned {len(samples)} samples for task {task.id}, not "
                           f"{group_size}; the engine is broken")
    samples, rewards = list(samples), []
    for i, s in enumerate(samples):
        try:
            rewards.append(reward_fn(task, s.text, s.finish_reason))
        except RewardTimeout as exc:
            # One hung call must not stall the rank: the sample ends here, with its reason in its
            # row (counted by aggregation, its group kept out of training) and in the log.
            _log.warning("sample %d of task %s ends without a reward: %s", i, task.id, exc)
            samples[i] = dataclasses.replace(s, finish_reason=TIMED_OUT)
            rewards.append(0.0)
    return Group(task, prompt_ids, samples, rewards)


def _rows(group: Group, *, split: str, iteration: int, rank: int, generation: int, policy_iteration: int) -> list[dict]:
    return [{
        "task_id": group.task.id, "sample_index": j, "prompt": group.task.prompt, "prompt_ids": group.prompt_ids,
        "completion_ids": s.token_ids, "logprobs": s.logprobs, "text": s.text, "reward": r,
        "finish_reason": s.finish_reason, "policy_iteration": policy_iteration, "iteration": iteration,
        "split": split, "rank": rank, "generation": generation,
    } for j, (s, r) in enumerate(zip(group.samples, group.rewards))]


def _resume(layout: RunLayout, split: str, iteration: int, rank: int, generation: int, run_id: str,
            ids: list[str], group_size: int) -> tuple[Manifest, int]:
    """Chunks already written for this rank: (manifest of what they cover, next sequence number)."""
    rank_dir = layout.rollout_rank_dir(split, iteration, rank)
    chunks = list_chunks(rank_dir)
    newer = [c.name for c in chunks if c.generation > generation]
    if newer:
        raise RolloutError(f"rank {rank}: {rank_dir} holds {newer[0]} of generation {max(c.generation for c in chunks)}, "
                           f"newer than this process's generation {generation}; this process has been superseded")
    order = {t: i for i, t in enumerate(ids)}
    manifest = Manifest(split, iteration, rank, group_size, policy_iteration=0)
    missing = set(ids)
    for chunk in chunks:
        if not missing:
            break
        try:
            table = read_chunk(chunk.path, run_id=run_id, columns=["task_id", "sample_index", "completion_ids"])
        except store.TrajectoryFileError as exc:
            # Chunks are published atomically, so this is damage, not a race; its tasks are redone.
            _log.warning("rank %d: ignoring unreadable chunk (its tasks will be rolled out again): %s", rank, exc)
            continue
        taken = sorted(complete_groups(table, missing, group_size), key=order.__getitem__)
        if taken:
            manifest.chunks.append({"name": chunk.name, "task_ids": taken})
            manifest.completion_tokens += completion_tokens(table, taken)
            missing.difference_update(taken)
    manifest.resumed_tasks = len(ids) - len(missing)
    manifest.samples = manifest.resumed_tasks * group_size
    return manifest, (chunks[-1].seq + 1 if chunks else 0)


@dataclass(frozen=True)
class RolloutTarget:
    """Where one rank's rollouts of one iteration are written and what they carry: the run folder,
    split, iteration and rank, the writer's run id and claim generation, the policy sampled."""

    layout: RunLayout
    split: str
    iteration: int
    rank: int
    run_id: str
    generation: int
    policy_iteration: int


@dataclass(frozen=True)
class Sampler:
    """How the samples are made and scored: the engine and its tokenizer, the rollout config, the
    reward, and the split's sampling settings and group size (`sampling_for`)."""

    engine: Engine
    tokenizer: Any
    cfg: RolloutConfig
    reward_fn: RewardFn
    sampling: Sampling
    group_size: int


def rollout_rank(target: RolloutTarget, sampler: Sampler, tasks: Sequence[Task], *,
                 on_progress: Callable[[int, int, str], None] | None = None,
                 fence: Callable[[], None] | None = None) -> RolloutSummary:
    """Roll out this rank's `tasks` (G = `sampler.group_size` samples each), write chunks and DONE.

    Idempotent: a DONE of this generation or an older one that already lists every task is
    (re)published under this generation and returned without generating anything."""
    layout, split, iteration, rank = target.layout, target.split, target.iteration, target.rank
    run_id, generation, policy_iteration = target.run_id, target.generation, target.policy_iteration
    engine, tokenizer, cfg = sampler.engine, sampler.tokenizer, sampler.cfg
    reward_fn, sampling, group_size = sampler.reward_fn, sampler.sampling, sampler.group_size
    t0 = time.monotonic()
    fence = fence or (lambda: None)
    report = on_progress or (lambda done, total, message: None)
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise RolloutError(f"rank {rank}: the task list repeats ids; task ids must be unique")
    total = len(tasks)
    done_path = layout.rollout_done(split, iteration, rank)
    try:
        previous, previous_gen = read_done(done_path, run_id=run_id)
    except NotThereYet:
        previous, previous_gen = None, None
    if previous_gen is not None and previous_gen > generation:
        raise RolloutError(f"rank {rank}: {done_path} was written by generation {previous_gen}, newer than this "
                           f"process's generation {generation}; this process has been superseded")
    if previous is not None and previous.covers(ids, group_size):
        if previous_gen != generation:
            fence()
            publish_done(done_path, previous, run_id=run_id, generation=generation)
        report(total, total, f"{split} rollout already done ({total} tasks)")
        return RolloutSummary(total, previous.samples, previous.completion_tokens, time.monotonic() - t0,
                              len(previous.chunks), resumed_tasks=total)

    manifest, seq = _resume(layout, split, iteration, rank, generation, run_id, ids, group_size)
    manifest.policy_iteration = policy_iteration
    covered = {t for c in manifest.chunks for t in c["task_ids"]}
    todo = [t for t in tasks if t.id not in covered]
    _log.info("rank %d %s iter %d: %d tasks x %d samples; %d already in chunks, rolling out %d",
              rank, split, iteration, total, group_size, len(covered), len(todo))
    report(len(covered), total, f"rolling out {len(covered)}/{total} {split} tasks")

    buffer: list[Group] = []
    last_flush = time.monotonic()

    def flush() -> None:
        nonlocal seq, last_flush
        if not buffer:
            return
        rows = [r for g in buffer for r in _rows(g, split=split, iteration=iteration, rank=rank,
                                                  generation=generation, policy_iteration=policy_iteration)]
        path = layout.rollout_chunk(split, iteration, rank, seq, generation)
        fence()
        write_chunk(path, rows, run_id=run_id, generation=generation)
        manifest.chunks.append({"name": path.name, "task_ids": [g.task.id for g in buffer]})
        seq += 1
        buffer.clear()
        last_flush = time.monotonic()

    gen_t0 = time.monotonic()
    with Progress(f"rank {rank} {split} rollout iter {iteration}", total=len(todo), unit="tasks") as bar:
        finished = len(covered)

        def take(groups: list[Group]) -> None:
            nonlocal finished
            tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
            manifest.generated_samples += len(groups) * group_size
            manifest.generated_tokens += tokens
            manifest.samples += len(groups) * group_size
            manifest.completion_tokens += tokens
            buffer.extend(groups)
            if len(buffer) >= cfg.chunk_groups or time.monotonic() - last_flush >= cfg.chunk_seconds:
                flush()
            bar.advance(len(groups), samples=len(groups) * group_size, tokens=tokens)
            finished += len(groups)
            report(finished, total, f"rolling out {finished}/{total} {split} tasks")

        if engine.rolling and todo:
            # One call for all of them: the engine keeps its window of requests full to the last
            # task, and each group lands in the next chunk as soon as it is scored (in the order
            # they finish; a chunk names its tasks, so resuming does not depend on the order).
            call = dataclasses.replace(sampling, seed=call_seed(sampling.seed, split, iteration, [t.id for t in todo]))
            prompt_ids = [encode_prompt(tokenizer, t) for t in todo]
            engine.generate(prompt_ids, group_size, call, on_result=lambda i, samples: take(
                [_scored(engine, todo[i], prompt_ids[i], samples, group_size, reward_fn)]))
        else:
            for start in range(0, len(todo), cfg.prompts_per_call):
                batch = todo[start:start + cfg.prompts_per_call]
                call = dataclasses.replace(sampling, seed=call_seed(sampling.seed, split, iteration, [t.id for t in batch]))
                take(roll_groups(engine, tokenizer, batch, group_size, call, reward_fn))
        flush()
    manifest.seconds = time.monotonic() - gen_t0
    fence()
    publish_done(done_path, manifest, run_id=run_id, generation=generation)
    elapsed = time.monotonic() - t0
    rate = manifest.generated_tokens / manifest.seconds if manifest.seconds > 0 else 0.0
    _log.info("rank %d %s iter %d done: %d tasks, %d samples (%d new), %d chunks, %.1f tokens/s, %.1f s",
              rank, split, iteration, total, manifest.samples, manifest.generated_samples, len(manifest.chunks),
              rate, elapsed)
    return RolloutSummary(total, manifest.samples, manifest.completion_tokens, elapsed, len(manifest.chunks),
                          manifest.resumed_tasks, manifest.generated_samples, manifest.generated_tokens)


# -- command line: roll out one rank by hand (and the crash-and-restart tests) -----------------

def _main_impl(log_path: str, model_dir: str, task_file: str, split: str, iteration: int, rank: int,
               generation: int, run_id: str, rank_weights: str, tasks_per_iteration: int, reward: str,
               policy_iteration: int, overrides: tuple[str, ...]) -> RolloutSummary:
    weights = parse_rank_weights(rank_weights)  # the run's own rule
    cfg = load(RolloutConfig, [], list(overrides))
    pool = load_tasks(Path(task_file))
    tasks = pool if tasks_per_iteration == 0 else sample_iteration(
        pool, tasks_per_iteration, seed=cfg.seed, iteration=iteration)
    mine = rank_slice(tasks, weights, rank)
    sampling, group_size = sampling_for(cfg, split)
    served, adapter = serving_weights(Path(model_dir))  # an adapters-only checkpoint: its base + adapter/
    with TransformersEngine() as engine:
        engine.start(served)
        engine.set_adapter(adapter)
        return rollout_rank(RolloutTarget(RunLayout(Path(log_path)), split, iteration, rank, run_id=run_id,
                                          generation=generation, policy_iteration=policy_iteration),
                            Sampler(engine, engine.tokenizer, cfg, load_reward(reward), sampling, group_size), mine)


def main() -> None:
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)

    @click.command(context_settings={"show_default": True})
    @click.option("--log-path", required=True, help="run directory (shared --log-path)")
    @click.option("--model-dir", required=True, help="Hugging Face model folder to sample from")
    @click.option("--tasks", "task_file", required=True, help="JSONL task file (the pool)")
    @click.option("--split", type=click.Choice(["train", "eval"]), default="train")
    @click.option("--iteration", type=int, default=1)
    @click.option("--rank", type=int, default=0)
    @click.option("--generation", type=int, default=1, help="claim generation of this process")
    @click.option("--run-id", required=True, help="run id the written files carry")
    @click.option("--rank-weights", default="1", help="comma-separated weight per rank")
    @click.option("--tasks-per-iteration", type=int, default=0, help="seeded sample size; 0 = the whole file")
    @click.option("--reward", default="arithmetic", help="arithmetic | math | package.module:function")
    @click.option("--policy-iteration", type=int, default=0, help="checkpoint iteration that samples")
    @click.argument("overrides", nargs=-1)
    def cli(**kw: Any) -> None:
        """Roll out one rank's share with the transformers engine. OVERRIDES are rollout config
        keys, e.g. group_size=4 chunk_groups=1."""
        log.setup(f"rank{kw['rank']} rollout")
        overrides = kw.pop("overrides")
        try:
            summary = _main_impl(overrides=overrides, **kw)
        except (ValueError, RolloutError, EngineError, CheckpointError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{summary.tasks} tasks, {summary.samples} samples ({summary.resumed_tasks} tasks resumed), "
                   f"{summary.chunks} chunks, {summary.seconds:.1f} s")

    cli()


if __name__ == "__main__":
    main()
