"""The rollout worker: one rank's share of an iteration's tasks -> scored episodes (groups of G per
task, rollout/episodes.py) -> chunk files -> DONE (docs/design.md §6 phases 1 and 5, §7).

Resumable by construction. Chunks are immutable and named with the writer's generation, so a
restarted (or fenced) process never overwrites anything. On start the worker reads every chunk
already in its rank folder, whatever generation wrote it, keeps each task's first complete
group in (sequence, generation) order, and rolls out only the tasks still missing. A node that
dies mid-rollout therefore loses at most the groups of its last engine call and unflushed
buffer; nothing is duplicated because DONE names exactly which chunk each task is taken from.
"""
from __future__ import annotations

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
from rollout.engine import Engine, EngineError, Sampling
from rollout.engines.transformers_engine import TransformersEngine
from rollout.envs import EnvError, EnvFactory, load_env
from rollout.episodes import FAILED, Bounds, EpisodeGroup, run_episodes
from rollout.rewards import RewardFn, load_reward
from rollout.scoring import Scoring
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
                reward_fn: RewardFn, *, env_factory: EnvFactory | None = None,
                bounds: Bounds | None = None, scoring: Scoring | None = None) -> list[EpisodeGroup]:
    """`group_size` scored episodes of each task, in memory, in task order (eval without files)."""
    groups: dict[str, EpisodeGroup] = {}
    run_episodes(engine, tokenizer, tasks, group_size, sampling, reward_fn=reward_fn, env_factory=env_factory,
                 bounds=bounds or bounds_of(RolloutConfig()), on_group=lambda g: groups.__setitem__(g.task.id, g),
                 scoring=scoring)
    return [groups[t.id] for t in tasks]


def bounds_of(cfg: RolloutConfig) -> Bounds:
    return Bounds(cfg.max_turns, cfg.max_episode_tokens, cfg.env_step_timeout)


def _rows(group: EpisodeGroup, *, split: str, iteration: int, rank: int, generation: int,
          policy_iteration: int) -> list[dict]:
    return [{
        "task_id": group.task.id, "sample_index": e.index, "prompt": group.task.prompt, "prompt_ids": e.prompt_ids,
        "completion_ids": e.ids, "logprobs": e.logprobs, "loss_mask": e.loss_mask, "turn_starts": e.turn_starts,
        "turns": e.turns, "termination": e.termination, "error": e.error or None, "step_rewards": e.step_rewards,
        "reward_parts": [{"name": k, "value": v} for k, v in e.reward_parts.items()],
        "text": e.text, "reward": e.reward, "finish_reason": e.finish_reason, "policy_iteration": policy_iteration,
        "iteration": iteration, "split": split, "rank": rank, "generation": generation,
    } for e in group.episodes]


def _resume(layout: RunLayout, split: str, iteration: int, rank: int, generation: int, run_id: str,
            ids: list[str], group_size: int) -> tuple[Manifest, int, list[tuple]]:
    """Chunks already written for this rank: (manifest of what they cover, next sequence number,
    the failed episodes among them as (task, sample, termination, error))."""
    rank_dir = layout.rollout_rank_dir(split, iteration, rank)
    chunks = list_chunks(rank_dir)
    newer = [c.name for c in chunks if c.generation > generation]
    if newer:
        raise RolloutError(f"rank {rank}: {rank_dir} holds {newer[0]} of generation {max(c.generation for c in chunks)}, "
                           f"newer than this process's generation {generation}; this process has been superseded")
    order = {t: i for i, t in enumerate(ids)}
    manifest = Manifest(split, iteration, rank, group_size, policy_iteration=0)
    missing = set(ids)
    failures: list[tuple] = []
    for chunk in chunks:
        if not missing:
            break
        try:
            table = read_chunk(chunk.path, run_id=run_id, columns=["task_id", "sample_index", "loss_mask",
                                                                     "termination", "error"])
        except store.TrajectoryFileError as exc:
            # Chunks are published atomically, so this is damage, not a race; its tasks are redone.
            _log.warning("rank %d: ignoring unreadable chunk (its tasks will be rolled out again): %s", rank, exc)
            continue
        taken = sorted(complete_groups(table, missing, group_size), key=order.__getitem__)
        if taken:
            manifest.chunks.append({"name": chunk.name, "task_ids": taken})
            manifest.completion_tokens += completion_tokens(table, taken)
            missing.difference_update(taken)
            failures += _failed(table, set(taken))
    manifest.resumed_tasks = len(ids) - len(missing)
    manifest.samples = manifest.resumed_tasks * group_size
    return manifest, (chunks[-1].seq + 1 if chunks else 0), failures


def _failed(table: Any, task_ids: set[str]) -> list[tuple]:
    rows = zip(*(table[c].to_pylist() for c in ("task_id", "sample_index", "termination", "error")))
    return [r for r in rows if r[0] in task_ids and r[2] in FAILED]


def check_env_errors(failures: list[tuple], episodes: int, max_rate: float, *, rank: int, split: str,
                     iteration: int) -> None:
    """Fail the rank's rollout when more than `max_rate` of its `episodes` ended for their
    environment's or their judge's fault, quoting the first errors: an environment or a judge that
    mostly fails is broken, and training on what is left of it would hide that."""
    if episodes and len(failures) > max_rate * episodes:
        quoted = "; ".join(f"task {t} episode {i} ({term}): {err}" for t, i, term, err in failures[:3])
        raise RolloutError(f"rank {rank} {split} iter {iteration}: {len(failures)} of {episodes} episodes ended with "
                           f"an environment error, timeout or judge error, more than rollout.max_env_error_rate="
                           f"{max_rate:g}; first errors: {quoted}. Fix the environment or the judge (or raise "
                           f"rollout.max_env_error_rate)")


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
    """How the episodes are made and scored: the engine and its tokenizer, the rollout config, the
    reward, the split's sampling settings and group size (`sampling_for`), the environment
    factory of multi-turn episodes (None: single-turn tasks) and the reward's parts and judge
    (`scoring`, rollout/scoring.py; None: the environment's step rewards summed, no judge)."""

    engine: Engine
    tokenizer: Any
    cfg: RolloutConfig
    reward_fn: RewardFn
    sampling: Sampling
    group_size: int
    env_factory: EnvFactory | None = None
    scoring: Scoring | None = None


def rollout_rank(target: RolloutTarget, sampler: Sampler, tasks: Sequence[Task], *,
                 on_progress: Callable[[int, int, str], None] | None = None,
                 fence: Callable[[], None] | None = None) -> RolloutSummary:
    """Roll out this rank's `tasks` (G = `sampler.group_size` episodes each), write chunks and DONE.

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

    manifest, seq, failures = _resume(layout, split, iteration, rank, generation, run_id, ids, group_size)
    manifest.policy_iteration = policy_iteration
    covered = {t for c in manifest.chunks for t in c["task_ids"]}
    todo = [t for t in tasks if t.id not in covered]
    _log.info("rank %d %s iter %d: %d tasks x %d samples; %d already in chunks, rolling out %d",
              rank, split, iteration, total, group_size, len(covered), len(todo))
    report(len(covered), total, f"rolling out {len(covered)}/{total} {split} tasks")

    buffer: list[EpisodeGroup] = []
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

        def take(group: EpisodeGroup) -> None:
            nonlocal finished
            tokens = sum(sum(e.loss_mask) for e in group.episodes)
            turns = sum(e.turns for e in group.episodes)
            failures.extend((group.task.id, e.index, e.termination, e.error) for e in group.episodes
                            if e.termination in FAILED)
            manifest.generated_samples += group_size
            manifest.generated_tokens += tokens
            manifest.samples += group_size
            manifest.completion_tokens += tokens
            buffer.append(group)
            if len(buffer) >= cfg.chunk_groups or time.monotonic() - last_flush >= cfg.chunk_seconds:
                flush()
            bar.advance(1, episodes=group_size, turns=turns, tokens=tokens)
            finished += 1
            rates = bar.rates()
            report(finished, total, f"rolling out {finished}/{total} {split} tasks, {rates['episodes/s']:.1f} "
                                    f"episodes/s, {rates['turns/s']:.1f} turns/s")

        # A rolling engine (vLLM) takes every task at once and keeps its window of requests full to
        # the last one; an engine that batches in its own process gets prompts_per_call tasks a time.
        # Either way each group lands in the next chunk as soon as its last episode ends (in the order
        # they finish; a chunk names its tasks, so resuming does not depend on the order).
        per_call = len(todo) if engine.rolling else cfg.prompts_per_call
        for start in range(0, len(todo), max(per_call, 1)):
            batch = todo[start:start + per_call]
            times = run_episodes(engine, tokenizer, batch, group_size, sampling, reward_fn=reward_fn,
                                 env_factory=sampler.env_factory, bounds=bounds_of(cfg), on_group=take,
                                 seed_of=lambda keys: call_seed(sampling.seed, split, iteration, keys),
                                 scoring=sampler.scoring)
            manifest.generated_turns += times.turns
            manifest.generation_seconds += times.generation_s
            manifest.env_wait_seconds += times.env_wait_s
            manifest.env_seconds += times.env_s
            manifest.env_calls += times.env_calls
        flush()
    check_env_errors(failures, total * group_size, cfg.max_env_error_rate, rank=rank, split=split, iteration=iteration)
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
               generation: int, run_id: str, rank_weights: str, tasks_per_iteration: int, reward: str, env: str,
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
                            Sampler(engine, engine.tokenizer, cfg, load_reward(reward), sampling, group_size,
                                    load_env(env) if env else None), mine)


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
    @click.option("--env", default="", help="environment of multi-turn episodes: calculator | guess | "
                                            "package.module:factory; empty = single-turn tasks")
    @click.option("--policy-iteration", type=int, default=0, help="checkpoint iteration that samples")
    @click.argument("overrides", nargs=-1)
    def cli(**kw: Any) -> None:
        """Roll out one rank's share with the transformers engine. OVERRIDES are rollout config
        keys, e.g. group_size=4 chunk_groups=1."""
        log.setup(f"rank{kw['rank']} rollout")
        overrides = kw.pop("overrides")
        try:
            summary = _main_impl(overrides=overrides, **kw)
        except (ValueError, RolloutError, EngineError, CheckpointError, EnvError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{summary.tasks} tasks, {summary.samples} samples ({summary.resumed_tasks} tasks resumed), "
                   f"{summary.chunks} chunks, {summary.seconds:.1f} s")

    cli()


if __name__ == "__main__":
    main()
