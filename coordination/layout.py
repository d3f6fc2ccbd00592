"""Every path under `--log-path`, in one place (docs/design.md §4).

Nobody else formats a path inside the run directory: they ask `RunLayout` (run-level files,
rollouts, training, checkpoints, metrics) or its `JobLayout` (claims, heartbeats, barriers,
timelines and logs of one job). Names are scoped by iteration, phase and attempt so that no
name is ever reused while a run is live (protocol rule 4).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

JOBS = ("both", "rollout", "update", "eval", "bench")  # eval: --rl-phase rollout --rollout-split eval-only;
# bench: run.sh --bench (the trainer's benchmark as one torchrun over the nodes)
SPLITS = ("train", "eval")

_CLAIM_RE = re.compile(r"^claim-(\d+)$")
_CHUNK_RE = re.compile(r"^chunk-(\d+)-g(\d+)\.parquet$")
_ITER_RE = re.compile(r"^iter-(\d+)$")


def _check_job(job: str) -> None:
    if job not in JOBS:
        raise ValueError(f"job must be one of {', '.join(JOBS)} (got {job!r})")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"rollout split must be one of {', '.join(SPLITS)} (got {split!r})")


def iteration_number(name: str) -> int | None:
    """`iter-12` -> 12; anything else -> None."""
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def chunk_identity(name: str) -> tuple[int, int] | None:
    """`chunk-00003-g2.parquet` -> (3, 2) = (sequence number, writer generation); else None."""
    m = _CHUNK_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def barrier_name(phase: int, name: str, attempt: int = 1) -> str:
    """Folder name of one barrier: `02-train-rollout-done`, `10-train.a2` for a retry."""
    base = f"{phase:02d}-{name}"
    return base if attempt == 1 else f"{base}.a{attempt}"


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run directory (the shared `--log-path`)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # -- run level -------------------------------------------------------------------------
    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def config_yaml(self) -> Path:
        return self.root / "config.yaml"

    def config_change(self, number: int) -> Path:
        """Record of a config change accepted with `--resume` (one file per change)."""
        return self.root / "config-changes" / f"change-{number:04d}.json"

    @property
    def config_changes_dir(self) -> Path:
        return self.root / "config-changes"

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    def job(self, job: str) -> "JobLayout":
        _check_job(job)
        return JobLayout(self, job)

    # -- rollouts ----------------------------------------------------------------------------
    def rollout_iter_dir(self, split: str, iteration: int) -> Path:
        _check_split(split)
        return self.root / "rollouts" / split / f"iter-{iteration}"

    def rollout_rank_dir(self, split: str, iteration: int, rank: int) -> Path:
        return self.rollout_iter_dir(split, iteration) / f"rank-{rank}"

    def rollout_chunk(self, split: str, iteration: int, rank: int, seq: int, generation: int) -> Path:
        """Immutable chunk `seq` written by generation `generation` of `rank`.

        The writer's generation is part of the name so that a fenced (stale) process can never
        overwrite a chunk of its successor."""
        return self.rollout_rank_dir(split, iteration, rank) / f"chunk-{seq:05d}-g{generation}.parquet"

    def rollout_done(self, split: str, iteration: int, rank: int) -> Path:
        return self.rollout_rank_dir(split, iteration, rank) / "DONE"

    def rollout_all(self, split: str, iteration: int) -> Path:
        return self.rollout_iter_dir(split, iteration) / "all.parquet"

    def rollout_stats(self, split: str, iteration: int) -> Path:
        return self.rollout_iter_dir(split, iteration) / "stats.json"

    # -- training ----------------------------------------------------------------------------
    def training_dir(self, iteration: int) -> Path:
        return self.root / "training" / f"iter-{iteration}"

    def training_plan(self, iteration: int) -> Path:
        return self.training_dir(iteration) / "plan.json"

    def training_shard(self, iteration: int, rank: int) -> Path:
        """Trainer rank `rank`'s share of the prepared training data (Parquet)."""
        return self.training_dir(iteration) / f"rank-{rank}.parquet"

    @classmethod
    def from_training_plan(cls, plan: Path) -> tuple["RunLayout", int]:
        """(layout, iteration) of a `training/iter-N/plan.json` path, so that the trainer needs only
        `--plan` and works wherever a node mounts the run directory."""
        plan = Path(plan).absolute()
        iteration = iteration_number(plan.parent.name)
        layout = cls(plan.parent.parent.parent)
        if iteration is None or layout.training_plan(iteration) != plan:
            raise ValueError(f"{plan} is not a training plan path of a run directory "
                             f"(expected <log-path>/training/iter-N/plan.json)")
        return layout, iteration

    def training_result(self, iteration: int, attempt: int, rank: int) -> Path:
        """Per-trainer-rank summary of one attempt (loss, tokens/s, ...)."""
        return self.training_dir(iteration) / f"attempt-{attempt}" / f"result-rank-{rank}.json"

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints_dir / f"iter-{iteration}"

    def checkpoint_staging(self, iteration: int, attempt: int) -> Path:
        """Where an attempt assembles a checkpoint before it is renamed into place."""
        return self.checkpoints_dir / ".staging" / f"iter-{iteration}.a{attempt}"

    @property
    def checkpoint_staging_dir(self) -> Path:
        return self.checkpoints_dir / ".staging"

    @property
    def checkpoint_trash_dir(self) -> Path:
        """Retention renames a checkpoint here before deleting it, so that a reader sees a
        checkpoint folder either whole or not at all."""
        return self.checkpoints_dir / ".trash"

    @property
    def latest(self) -> Path:
        return self.checkpoints_dir / "LATEST"

    # -- metrics, timeline, logs -------------------------------------------------------------
    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    def metrics(self, iteration: int) -> Path:
        return self.metrics_dir / f"iter-{iteration}.json"

    @property
    def timeline_dir(self) -> Path:
        return self.root / "timeline"

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        return self.root / "wandb"

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    def bench_result(self, job: str, rank: int) -> Path:
        """Per-rank numbers of `python -m coordination.bench` runs."""
        return self.root / "bench" / f"{job}-rank-{rank}.json"

    def bench_work(self, job: str, rank: int) -> Path:
        """Log of the benchmark job's phase actions (tests check that none ran twice)."""
        return self.root / "bench" / f"{job}-rank-{rank}-actions.jsonl"


@dataclass(frozen=True)
class JobLayout:
    """Paths that belong to one job (`both`, `rollout`, `update`, `eval` or `bench`) of a run."""

    run: RunLayout
    name: str

    @property
    def root(self) -> Path:
        return self.run.root / "jobs" / self.name

    @property
    def job_json(self) -> Path:
        return self.root / "job.json"

    @property
    def master_json(self) -> Path:
        return self.root / "master.json"

    @property
    def progress_json(self) -> Path:
        """The last iteration this job completed (rewritten by its master at every iteration end)."""
        return self.root / "progress.json"

    @property
    def nodes_dir(self) -> Path:
        return self.root / "nodes"

    def node_dir(self, rank: int) -> Path:
        return self.nodes_dir / f"rank-{rank}"

    def claim(self, rank: int, generation: int) -> Path:
        return self.node_dir(rank) / f"claim-{generation}"

    def heartbeat(self, rank: int) -> Path:
        return self.node_dir(rank) / "heartbeat.json"

    def claim_generations(self, rank: int) -> list[int]:
        """Generations of every claim file of `rank`, ascending (a directory listing: call rarely)."""
        try:
            names = [p.name for p in self.node_dir(rank).iterdir()]
        except FileNotFoundError:
            return []
        gens = [int(m.group(1)) for n in names if (m := _CLAIM_RE.match(n))]
        return sorted(gens)

    @property
    def sync_dir(self) -> Path:
        return self.root / "sync"

    def sync_iter_dir(self, iteration: int) -> Path:
        return self.sync_dir / f"iter-{iteration}"

    def barrier_dir(self, iteration: int, phase: int, name: str, attempt: int = 1) -> Path:
        return self.sync_iter_dir(iteration) / barrier_name(phase, name, attempt)

    def arrival(self, iteration: int, phase: int, name: str, rank: int, attempt: int = 1) -> Path:
        return self.barrier_dir(iteration, phase, name, attempt) / f"rank-{rank}"

    def go(self, iteration: int, phase: int, name: str, attempt: int = 1) -> Path:
        return self.barrier_dir(iteration, phase, name, attempt) / "GO"

    def timeline(self, rank: int) -> Path:
        return self.run.timeline_dir / f"{self.name}-rank-{rank}.jsonl"

    def logs_dir(self, rank: int) -> Path:
        return self.run.root / "logs" / self.name / f"rank-{rank}"

    @property
    def bench_json(self) -> Path:
        """run.sh --bench: the benchmark's results, written by the trainer's global rank 0."""
        return self.root / "bench.json"

    def bench_config(self, rank: int) -> Path:
        """run.sh --bench: the run's `train` section as the trainer's --bench reads it (--config)."""
        return self.logs_dir(rank) / "bench-train.yaml"

    def log_file(self, rank: int, component: str) -> Path:
        """`driver.log`, `inference.log`, `trainer.log` ... of one rank."""
        return self.logs_dir(rank) / f"{component}.log"
