"""The trajectory schema and its only reader and writer (docs/design.md §11.3).

Rollout chunks, the aggregated `all.parquet` of an iteration and the trainer's inputs all use
this one schema. Files are Parquet (no pickle), published atomically.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from coordination.layout import check_no_links
from coordination.records import atomic_output

SCHEMA = pa.schema([
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("sample_index", pa.int32(), nullable=False),
    pa.field("prompt", pa.string()),                       # prompt text, for people and reports
    pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
    # An episode after its prompt: the policy's turns and the environment's answers, as token ids.
    pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),  # sampling logprob per token; 0 on context
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),    # 1 on the policy's tokens
    pa.field("turn_starts", pa.list_(pa.int32()), nullable=False),  # offset of each policy turn in completion_ids
    pa.field("turns", pa.int32(), nullable=False),
    pa.field("termination", pa.string(), nullable=False),  # done, max_turns, max_tokens, env_error, timeout, judge_error
    pa.field("error", pa.string()),                        # why an env_error, timeout or judge_error episode ended
    pa.field("step_rewards", pa.list_(pa.float32()), nullable=False),  # the rewards the environment's steps gave
    # The named parts whose sum is `reward` (rollout/scoring.py): "env", "reward", "judge".
    pa.field("reward_parts", pa.list_(pa.struct([("name", pa.string()), ("value", pa.float32())])), nullable=False),
    pa.field("text", pa.string()),                         # decoded turns and observations
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("finish_reason", pa.string()),                # of the last turn: "stop" (eos) or "length"
    pa.field("policy_iteration", pa.int32(), nullable=False),  # checkpoint iteration that sampled it (0 = base)
    pa.field("iteration", pa.int32(), nullable=False),     # rollout iteration it belongs to
    pa.field("split", pa.string(), nullable=False),        # "train" or "eval"
    pa.field("rank", pa.int32(), nullable=False),
    pa.field("generation", pa.int32(), nullable=False),    # claim generation of the writing rank
])

COLUMNS = tuple(SCHEMA.names)
# Schema metadata key naming the run that wrote a file (chunks and all.parquet): a file of another
# run is refused by name, never read as this run's (docs/design.md §5 rule 2).
RUN_ID_KEY = b"baton.run_id"


class TrajectoryFileError(ValueError):
    """A trajectory file that is missing, unreadable or of another schema; names the file."""


def one_turn(completion_tokens: int) -> dict[str, Any]:
    """The episode columns of a one-turn episode that ended `done` with `completion_tokens` sampled
    tokens: what a single-turn task's row carries (benchmarks and tests that write rows by hand)."""
    return {"loss_mask": [1] * completion_tokens, "turn_starts": [0], "turns": 1, "termination": "done",
            "error": None, "step_rewards": [], "reward_parts": []}


def to_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    rows = list(rows)
    missing = [c for c in COLUMNS if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"trajectory rows lack columns {missing}")
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def write_table(path: Path, table: pa.Table, *, run_id: str | None = None) -> None:
    """Publish `table` (already in SCHEMA) atomically at `path`, tagged with `run_id` when given."""
    if table.schema != SCHEMA:
        table = table.cast(SCHEMA)
    if run_id is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), RUN_ID_KEY: run_id.encode()})
    with atomic_output(Path(path)) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def write_rows(path: Path, rows: Iterable[dict[str, Any]], *, run_id: str | None = None) -> int:
    table = to_table(rows)
    write_table(path, table, run_id=run_id)
    return table.num_rows


def read_table(path: Path, columns: list[str] | None = None, *, run_id: str | None = None) -> pa.Table:
    """Read one trajectory file, checking its schema (and with `run_id`, that this run wrote it).
    Errors name the file."""
    path = Path(path)
    check_no_links(path)  # a chunk linked in from elsewhere is not ours to read
    try:
        table = pq.read_table(path, columns=columns)
    except FileNotFoundError:
        raise TrajectoryFileError(f"trajectory file {path} does not exist") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise TrajectoryFileError(f"trajectory file {path} is unreadable: {exc}") from None
    if run_id is not None:
        owner = (table.schema.metadata or {}).get(RUN_ID_KEY, b"").decode()
        if owner != run_id:
            raise TrajectoryFileError(
                f"trajectory file {path} belongs to run {owner or '(unknown)'}, not to this run {run_id}; it was "
                f"copied or linked here from another run (or --log-path is shared with one): move it away")
    wanted = columns or list(COLUMNS)
    missing = [c for c in wanted if c not in table.column_names]
    if missing:
        raise TrajectoryFileError(f"trajectory file {path} lacks columns {missing}; was it written by baton?")
    expected = pa.schema([SCHEMA.field(c) for c in wanted])
    if table.select(wanted).schema.remove_metadata() != expected.remove_metadata():
        try:
            table = table.select(wanted).cast(expected)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise TrajectoryFileError(f"trajectory file {path} has an incompatible schema: {exc}") from None
    return table


def read_rows(path: Path, columns: list[str] | None = None) -> list[dict[str, Any]]:
    return read_table(path, columns).to_pylist()
