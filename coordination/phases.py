"""The phase table's shape (docs/design.md §6): numbers, names, who acts, where the barriers are.

Data only, so `status`, `recover`, the benchmark and the driver share one table without
importing rollout or train. The driver binds an action to each row.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Literal


class PhaseId(IntEnum):
    """The phase numbers by name, so code says `PhaseId.TRAIN` where it means phase 10."""

    SYNC = 0
    TRAIN_ROLLOUT = 1
    TRAIN_ROLLOUT_DONE = 2
    AGGREGATE_TRAIN = 3
    TRAIN_FILES_READY = 4
    EVAL = 5
    AGGREGATE_EVAL = 6
    STOP_INFERENCE = 7
    PREPARE_TRAINING_DATA = 8
    TRAINING_READY = 9
    TRAIN = 10
    PUBLISH_CHECKPOINT = 11
    RESTART_INFERENCE = 12
    ITERATION_DONE = 13


@dataclass(frozen=True)
class PhaseSpec:
    number: int
    name: str
    who: Literal["all", "master"]  # who runs the phase's action
    barrier: bool                  # all ranks arrive; the master releases GO
    summary: str

    def __post_init__(self) -> None:
        # Records, timelines and YAML hold the plain number, never the enum member.
        object.__setattr__(self, "number", int(self.number))


P = PhaseId

PHASES: tuple[PhaseSpec, ...] = (
    PhaseSpec(P.SYNC, "sync", "all", True, "iteration start; rollout jobs make sure the engine serves LATEST"),
    PhaseSpec(P.TRAIN_ROLLOUT, "train-rollout", "all", False, "each rank rolls out its weighted share of the train tasks"),
    PhaseSpec(P.TRAIN_ROLLOUT_DONE, "train-rollout-done", "all", True, "every rank finished its train rollouts"),
    PhaseSpec(P.AGGREGATE_TRAIN, "aggregate-train", "master", False, "merge rank chunks into all.parquet and stats"),
    PhaseSpec(P.TRAIN_FILES_READY, "train-files-ready", "all", True, "aggregated train rollouts are published; eval decided"),
    PhaseSpec(P.EVAL, "eval", "all", False, "eval iterations: each rank rolls out its share of the eval tasks"),
    PhaseSpec(P.AGGREGATE_EVAL, "aggregate-eval", "all", True, "the master merges eval rollouts into accuracy metrics"),
    PhaseSpec(P.STOP_INFERENCE, "stop-inference", "all", True, "stop or sleep the inference engine, free the accelerator"),
    PhaseSpec(P.PREPARE_TRAINING_DATA, "prepare-training-data", "master", False, "advantages, filtering, packing, training plan"),
    PhaseSpec(P.TRAINING_READY, "training-ready", "all", True, "GO carries the rendezvous endpoint, port and attempt"),
    PhaseSpec(P.TRAIN, "train", "all", True, "the resident trainer (or one torchrun) trains on all nodes; a failed attempt is retried"),
    PhaseSpec(P.PUBLISH_CHECKPOINT, "publish-checkpoint", "master", False, "checkpoint folder renamed into place, then LATEST"),
    PhaseSpec(P.RESTART_INFERENCE, "restart-inference", "all", False, "serve the new checkpoint (restart, reload or wake)"),
    PhaseSpec(P.ITERATION_DONE, "iteration-done", "all", True, "metrics of the iteration written"),
)

BY_NUMBER = {p.number: p for p in PHASES}

JOB_PHASES: dict[str, tuple[int, ...]] = {
    "both": tuple(P),
    "rollout": tuple(P)[P.SYNC:P.STOP_INFERENCE],  # phases 0-6
    "update": tuple(P)[P.STOP_INFERENCE:],  # phases 7-13
    "eval": (P.SYNC, P.EVAL, P.AGGREGATE_EVAL),  # --rl-phase rollout --rollout-split eval-only
    "bench": (P.SYNC, P.TRAINING_READY, P.TRAIN),  # run.sh --bench: join, rendezvous, one torchrun
}


def phases_of(job: str) -> list[PhaseSpec]:
    return [BY_NUMBER[n] for n in JOB_PHASES[job]]


def phase_name(number: int | None) -> str:
    spec = BY_NUMBER.get(number) if number is not None else None
    return spec.name if spec else "-"
