"""Every path under `--log-path`, in one place (docs/design.md §4).

Nobody else formats a path inside the run directory: they ask `RunLayout` (run-level files,
rollouts, training, checkpoints, metrics) or its `JobLayout` (claims, heartbeats, barriers,
timelines and logs of one job). Names are scoped by iteration, phase and attempt so that no
name is ever reused while a run is live (protocol rule 4).
"""
from __future__ import annotations

import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from coordination.phases import JOB_PHASES

JOBS = tuple(JOB_PHASES)  # the job names of the phase table, in its order (what each does: rl/jobs.py)
SPLITS = ("train", "eval")

_CLAIM_RE = re.compile(r"^claim-(\d+)$")
_CHUNK_RE = re.compile(r"^chunk-(\d+)-g(\d+)\.parquet$")
_ITER_RE = re.compile(r"^iter-(\d+)$")
_RESULT_RE = re.compile(r"^result-rank-(\d+)\.json$")


class LinkInRunFolder(RuntimeError):
    """A symbolic link inside a run folder, where baton expects its own folder or file."""


# Run folders this process works in (absolute, lexical), registered by every RunLayout. Paths
# below one of them are checked for links; links above it (the user's own choice of where the
# log path lives) are not our business.
_ROOTS: set[str] = set()
# Directories below a run root already seen to be real directories with no link on the way from
# the root. Checking is then one set lookup, so barrier polling costs no extra metadata operation
# (docs/design.md §5 rule 5); the cache lives as long as the process, and `forget_verified` drops
# what baton itself deletes.
_VERIFIED: set[str] = set()
_lock = threading.Lock()


def _register_root(root: Path) -> None:
    with _lock:
        _ROOTS.add(os.path.abspath(root))


def _root_of(path: str) -> str | None:
    """The innermost registered run root that holds `path` (or is it), else None."""
    best = None
    for root in _ROOTS:
        if (path == root or path.startswith(root.rstrip(os.sep) + os.sep)) and (best is None or len(root) > len(best)):
            best = root
    return best


def in_run_folder(path: Path) -> bool:
    """True when `path` lies in a run folder this process works in (no filesystem access)."""
    p = os.path.abspath(path)
    return p in _VERIFIED or _root_of(p) is not None


def check_no_links(path: Path) -> bool:
    """Refuse a symbolic link anywhere from the run root down to `path` (inclusive).

    baton never creates links in a run folder (docs/design.md §5 rule 11), so a link there was
    planted, and writing, reading or deleting through it would touch files outside the run --
    another run's barrier, a user's folder. Components that do not exist yet are fine (they will
    be created as real folders). Returns True when `path` lies in a registered run folder (the
    caller then also opens the last component with O_NOFOLLOW), False for paths outside every
    run folder, which are not checked."""
    p = os.path.abspath(path)
    if p in _VERIFIED:
        return True
    root = _root_of(p)
    if root is None:
        return False
    cur = root
    for part in Path(p).relative_to(root).parts:
        cur = os.path.join(cur, part)
        if cur in _VERIFIED:
            continue
        try:
            st = os.lstat(cur)
        except (FileNotFoundError, NotADirectoryError):
            return True
        if stat.S_ISLNK(st.st_mode):
            raise _symlink_refused(cur, root)
        if not stat.S_ISDIR(st.st_mode):
            return True  # a file: the last component, or a path the caller's own call will reject
        with _lock:
            _VERIFIED.add(cur)
    return True


def _symlink_refused(path: str, root: str) -> LinkInRunFolder:
    return LinkInRunFolder(
        f"{path} is a symbolic link (to {os.readlink(path)}) inside the run folder {root}; baton never "
        f"creates links there and refuses to write, read or delete through one, so that nothing "
        f"outside the run is touched. Remove the link (`rm {path}` removes only the link, not what it "
        f"points to) and start again")


def hard_link_refused(path: str, names: int) -> LinkInRunFolder:
    """The refusal of a file with more than one name, where baton (or a library for it) would append
    to or overwrite it in place: that would change the file under its other names too."""
    return LinkInRunFolder(
        f"{path} is a hard link (one file with {names} names) where baton keeps its own file; baton refuses to "
        f"append to or overwrite it, which would change the file under its other names too (another run's, "
        f"after `cp -al`). Remove this name (`rm {path}` leaves the other names alone) and start again")


def check_tree_has_no_links(folder: Path) -> None:
    """`check_no_links` down to `folder`, then refuse any symbolic link and any file with more than
    one name anywhere below it. For folders a library writes into by names of its own (W&B,
    TensorBoard), where baton cannot open each file itself: one walk before the library starts."""
    if not check_no_links(folder):
        return
    root = _root_of(os.path.abspath(folder))
    for dirpath, dirnames, filenames in os.walk(folder):  # never descends into a linked folder
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # removed meanwhile: nothing to write through
            if stat.S_ISLNK(st.st_mode):
                raise _symlink_refused(path, root)
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                raise hard_link_refused(path, st.st_nlink)


def forget_verified(path: Path) -> None:
    """Drop `path` and everything below it from the cache of verified folders (it was deleted)."""
    p = os.path.abspath(path)
    prefix = p.rstrip(os.sep) + os.sep
    with _lock:
        for d in [d for d in _VERIFIED if d == p or d.startswith(prefix)]:
            _VERIFIED.discard(d)


def _check_job(job: str) -> None:
    if job not in JOBS:
        raise ValueError(f"job must be one of {', '.join(JOBS)} (got {job!r})")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"rollout split must be one of {', '.join(SPLITS)} (got {split!r})")


def _listed(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern)) if folder.is_dir() else []


def iteration_number(name: str) -> int | None:
    """`iter-12` -> 12; anything else -> None."""
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def chunk_identity(name: str) -> tuple[int, int] | None:
    """`chunk-00003-g2.parquet` -> (3, 2) = (sequence number, writer generation); else None."""
    m = _CHUNK_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


_STAGING_RE = re.compile(r"^iter-(\d+)\.a(\d+)$")
_OPTIMIZER_STAGING_RE = re.compile(r"^iter-(\d+)\.a(\d+)\.optimizer$")
_BARRIER_RE = re.compile(r"^(\d\d)-[a-z0-9-]+(\.a\d+)?$")


def staging_identity(name: str) -> tuple[int, int] | None:
    """`iter-3.a2` (a checkpoint staging folder) -> (3, 2) = (iteration, attempt); else None."""
    m = _STAGING_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def optimizer_staging_identity(name: str) -> tuple[int, int] | None:
    """`iter-3.a2.optimizer` (an optimizer-state staging folder) -> (3, 2); else None."""
    m = _OPTIMIZER_STAGING_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def barrier_name(phase: int, name: str, attempt: int = 1) -> str:
    """Folder name of one barrier: `02-train-rollout-done`, `10-train.a2` for a retry."""
    base = f"{phase:02d}-{name}"
    return base if attempt == 1 else f"{base}.a{attempt}"


_BARRIER_RE = re.compile(r"^(\d{2})-([a-z][a-z0-9-]*?)(?:\.a([1-9]\d*))?$")


def barrier_identity(name: str) -> tuple[int, str, int] | None:
    """`10-train.a2` -> (10, "train", 2): the inverse of `barrier_name`; None for any other name
    (a folder baton did not create, which nothing may read as a barrier or delete)."""
    m = _BARRIER_RE.match(name)
    return (int(m.group(1)), m.group(2), int(m.group(3) or 1)) if m else None


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run directory (the shared `--log-path`)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        _register_root(self.root)

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

    def config_change_count(self) -> int:
        """How many config changes are recorded (a directory listing: once per `--resume`)."""
        if not self.config_changes_dir.exists():
            return 0
        return sum(1 for p in self.config_changes_dir.iterdir() if re.fullmatch(r"change-\d{4,}\.json", p.name))

    @property
    def stop_file(self) -> Path:
        return self.root / "STOP"

    def write_probe(self, host: str, pid: int, token: str) -> Path:
        """The file a start writes and removes to prove the run folder takes a real write; a temp
        name (records.is_temp_name), so `recover` clears one a crash left behind."""
        return self.root / f".write-probe.tmp-{host}-{pid}-{token}"

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

    def training_attempt_dir(self, iteration: int, attempt: int) -> Path:
        return self.training_dir(iteration) / f"attempt-{attempt}"

    def training_result(self, iteration: int, attempt: int, rank: int) -> Path:
        """Per-trainer-rank summary of one attempt (loss, tokens/s, ...)."""
        return self.training_attempt_dir(iteration, attempt) / f"result-rank-{rank}.json"

    def training_result_ranks(self, iteration: int, attempt: int) -> list[int]:
        """The trainer ranks that wrote a result of this attempt, ascending (a directory listing)."""
        try:
            names = [p.name for p in self.training_attempt_dir(iteration, attempt).iterdir()]
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _RESULT_RE.match(n)))

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, iteration: int) -> Path:
        return self.checkpoints_dir / f"iter-{iteration}"

    def checkpoint_staging(self, iteration: int, attempt: int) -> Path:
        """Where an attempt assembles a checkpoint before it is renamed into place."""
        return self.checkpoints_dir / ".staging" / f"iter-{iteration}.a{attempt}"

    def optimizer_staging(self, iteration: int, attempt: int) -> Path:
        """Where a resident trainer writes iteration N's optimizer state after the weights
        (docs/design.md §9.6); renamed to checkpoints/iter-N/optimizer once complete."""
        return self.checkpoints_dir / ".staging" / f"iter-{iteration}.a{attempt}.optimizer"

    @property
    def checkpoint_staging_dir(self) -> Path:
        return self.checkpoints_dir / ".staging"

    @property
    def checkpoint_trash_dir(self) -> Path:
        """Retention renames a checkpoint here before deleting it, so that a reader sees a
        checkpoint folder either whole or not at all."""
        return self.checkpoints_dir / ".trash"

    def checkpoint_trash(self, iteration: int, pid: int) -> Path:
        """Checkpoint `iteration` renamed away by process `pid` (two nodes' retention never collide)."""
        return self.checkpoint_trash_dir / f"iter-{iteration}-{pid}"

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
    def trainer_timeline_dir(self) -> Path:
        return self.timeline_dir / "trainer"

    def timeline_files(self) -> list[Path]:
        """Every job's rank timelines, by name (a directory listing)."""
        return _listed(self.timeline_dir, "*-rank-*.jsonl")

    def trainer_timeline_files(self) -> list[Path]:
        """Every node's resident-trainer timeline, by name (a directory listing)."""
        return _listed(self.trainer_timeline_dir, "*-rank-*.jsonl")

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    @property
    def wandb_dir(self) -> Path:
        """W&B's `dir`: it keeps its runs in `wandb/wandb/`; its cache, config, data and artifact
        folders are pointed below it too (`wandb_folders`), so nothing of W&B lands outside the run."""
        return self.root / "wandb"

    def wandb_folders(self) -> dict[str, Path]:
        """W&B's environment variable -> the folder in this run it names."""
        return {"WANDB_DIR": self.wandb_dir, "WANDB_CACHE_DIR": self.wandb_dir / "cache",
                "WANDB_CONFIG_DIR": self.wandb_dir / "config", "WANDB_DATA_DIR": self.wandb_dir / "data",
                "WANDB_ARTIFACT_DIR": self.wandb_dir / "artifacts"}

    @property
    def wandb_runs_dir(self) -> Path:
        return self.wandb_dir / "wandb"

    @property
    def wandb_core_logs_dir(self) -> Path:
        """Where W&B's service writes its own log (`$WANDB_CACHE_DIR/wandb/logs`); each W&B run links
        `logs/debug-core.log` to it."""
        return self.wandb_folders()["WANDB_CACHE_DIR"] / "wandb" / "logs"

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

    def trainer_dir(self, rank: int) -> Path:
        """The resident trainer of node `rank` (docs/design.md §2): its orders and its state."""
        return self.node_dir(rank) / "trainer"

    def trainer_order(self, rank: int, launch: str, seq: int) -> Path:
        """Order `seq` (1, 2, ...) the driver gives the trainer it launched as `launch` (the
        rendezvous id, unique per launch: names are never reused, docs/design.md §5 rule 4)."""
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", launch) or launch in (".", ".."):
            raise ValueError(f"a trainer launch id is a plain name (got {launch!r})")
        return self.trainer_dir(rank) / launch / f"order-{int(seq)}.json"

    def trainer_state(self, rank: int, local_rank: int) -> Path:
        """What trainer process `local_rank` of node `rank` is doing (pid, state, device memory)."""
        return self.trainer_dir(rank) / f"state-{int(local_rank)}.json"

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

    def trainer_timeline(self, rank: int) -> Path:
        """The state changes of node `rank`'s resident trainer (written by its local rank 0)."""
        return self.run.trainer_timeline_dir / f"{self.name}-rank-{rank}.jsonl"

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
