"""Rollout chunk files and the DONE manifest of one rank: what the worker writes and what the
worker (on restart) and the aggregator read back.

A chunk is an immutable Parquet file in rollout/store.py's schema, named by
`RunLayout.rollout_chunk(split, iteration, rank, seq, generation)`, whose schema metadata
carries the run id and writer generation. DONE is a JSON record (kind "rollout-done") listing
the chunks a rank accepted and, for each, the task ids taken from it: a chunk may also hold
rows nobody accepted (a group cut short, a task already covered by an earlier chunk, rows of a
fenced process), and readers take only the listed (chunk, task) rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from coordination.layout import check_no_links, chunk_identity
from coordination.records import Record, publish_record, read_record
from rollout import store

DONE_KIND = "rollout-done"
RUN_ID_KEY = store.RUN_ID_KEY
GENERATION_KEY = b"baton.generation"


class RolloutError(RuntimeError):
    """A rollout that cannot continue or an inconsistent rank folder; names the rank and file."""


@dataclass(frozen=True)
class ChunkFile:
    seq: int
    generation: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


def list_chunks(rank_dir: Path) -> list[ChunkFile]:
    """Chunk files of a rank folder in (sequence, generation) order; temp files are skipped."""
    check_no_links(rank_dir)  # never take a linked folder's files for this rank's chunks
    try:
        names = [p.name for p in Path(rank_dir).iterdir()]
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        ident = chunk_identity(name)
        if ident is not None:
            found.append(ChunkFile(ident[0], ident[1], Path(rank_dir) / name))
    return sorted(found, key=lambda c: (c.seq, c.generation))


def write_chunk(path: Path, rows: list[dict[str, Any]], *, run_id: str, generation: int) -> int:
    """Publish `rows` (store.SCHEMA) as one immutable chunk tagged with run id and generation."""
    table = store.to_table(rows).replace_schema_metadata(
        {RUN_ID_KEY: run_id.encode(), GENERATION_KEY: str(generation).encode()})
    store.write_table(path, table)
    return table.num_rows


def read_chunk(path: Path, *, run_id: str, columns: list[str] | None = None) -> pa.Table:
    """Read one chunk, refusing a chunk of another run. Raises store.TrajectoryFileError."""
    return store.read_table(path, columns, run_id=run_id)


def complete_groups(table: pa.Table, wanted: set[str], group_size: int) -> set[str]:
    """Task ids among `wanted` whose rows in `table` are exactly sample indices 0..group_size-1."""
    if not wanted or table.num_rows == 0:
        return set()
    rows = table.select(["task_id", "sample_index"]).filter(
        pc.is_in(table["task_id"], value_set=pa.array(sorted(wanted), pa.string())))
    if rows.num_rows == 0:
        return set()
    g = rows.group_by("task_id").aggregate([
        ("sample_index", "count"), ("sample_index", "count_distinct"),
        ("sample_index", "min"), ("sample_index", "max")])
    ok = pc.and_(
        pc.and_(pc.equal(g["sample_index_count"], group_size), pc.equal(g["sample_index_count_distinct"], group_size)),
        pc.and_(pc.equal(g["sample_index_min"], 0), pc.equal(g["sample_index_max"], group_size - 1)))
    return set(g.filter(ok)["task_id"].to_pylist())


def completion_tokens(table: pa.Table, task_ids: Sequence[str]) -> int:
    """The policy's tokens (loss mask 1) in the rows of `task_ids`."""
    if not task_ids:
        return 0
    rows = table.filter(pc.is_in(table["task_id"], value_set=pa.array(list(task_ids), pa.string())))
    return int(pc.sum(pc.list_flatten(rows["loss_mask"])).as_py() or 0)


@dataclass
class Manifest:
    """The content of a DONE record."""

    split: str
    iteration: int
    rank: int
    group_size: int
    policy_iteration: int
    chunks: list[dict[str, Any]] = field(default_factory=list)  # [{"name": ..., "task_ids": [...]}]
    samples: int = 0
    completion_tokens: int = 0
    resumed_tasks: int = 0
    generated_samples: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    # What this process's episodes did (rollout/episodes.py EpisodeTimes): turns sampled, wall
    # seconds in engine calls and blocked on the environment, summed environment call seconds.
    generated_turns: int = 0
    generation_seconds: float = 0.0
    env_wait_seconds: float = 0.0
    env_seconds: float = 0.0
    env_calls: int = 0

    @property
    def task_ids(self) -> list[str]:
        return [t for c in self.chunks for t in c["task_ids"]]

    def covers(self, task_ids: Sequence[str], group_size: int) -> bool:
        listed = self.task_ids
        return (self.group_size == group_size and len(listed) == len(set(listed))
                and set(listed) == set(task_ids))

    def to_data(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["tasks"] = len(self.task_ids)
        return data

    @classmethod
    def from_record(cls, rec: Record) -> "Manifest":
        d = rec.data
        try:
            chunks = [{"name": str(c["name"]), "task_ids": [str(t) for t in c["task_ids"]]} for c in d["chunks"]]
            return cls(split=d["split"], iteration=int(d["iteration"]), rank=int(d["rank"]),
                       group_size=int(d["group_size"]), policy_iteration=int(d["policy_iteration"]), chunks=chunks,
                       samples=int(d["samples"]), completion_tokens=int(d["completion_tokens"]),
                       resumed_tasks=int(d.get("resumed_tasks", 0)), generated_samples=int(d.get("generated_samples", 0)),
                       generated_tokens=int(d.get("generated_tokens", 0)), seconds=float(d.get("seconds", 0.0)),
                       generated_turns=int(d.get("generated_turns", 0)),
                       generation_seconds=float(d.get("generation_seconds", 0.0)),
                       env_wait_seconds=float(d.get("env_wait_seconds", 0.0)),
                       env_seconds=float(d.get("env_seconds", 0.0)), env_calls=int(d.get("env_calls", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutError(f"{rec.path}: not a valid rollout manifest ({exc!r}); remove it so the rank "
                               f"writes it again") from None


def read_done(path: Path, *, run_id: str) -> tuple[Manifest, int]:
    """(manifest, writer generation). Raises coordination.records.NotThereYet when absent."""
    rec = read_record(path, kind=DONE_KIND, run_id=run_id)
    return Manifest.from_record(rec), rec.generation


def publish_done(path: Path, manifest: Manifest, *, run_id: str, generation: int) -> None:
    publish_record(path, DONE_KIND, manifest.to_data(), run_id=run_id, generation=generation)


def chunk_path(rank_dir: Path, name: str) -> Path:
    """The chunk `name` listed in a manifest; refuses names that are not chunk file names."""
    if chunk_identity(name) is None or "/" in name:
        raise RolloutError(f"{rank_dir}/DONE lists {name!r}, which is not a chunk file name")
    return Path(rank_dir) / name


def parquet_rows(path: Path) -> int:
    return pq.read_metadata(path).num_rows
