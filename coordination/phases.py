"""The phase table's shape (docs/design.md §6): numbers, names, who acts, where the barriers are.

Data only, so `status`, `recover`, the benchmark and the driver share one table without
importing rollout or train. The driver binds an action to each row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PhaseSpec:
    number: int
    name: str
    who: Literal["all", "master"]  # who runs the phase's action
    barrier: bool                  # all ranks arrive; the master releases GO
    summary: str


PHASES: tuple[PhaseSpec, ...] = (
    PhaseSpec(0, "sync", "all", True, "iteration start; rollout jobs make sure the engine serves LATEST"),
    PhaseSpec(1, "train-rollout", "all", False, "each rank rolls out its weighted share of the train tasks"),
    PhaseSpec(2, "train-rollout-done", "all", True, "every rank finished its train rollouts"),
    PhaseSpec(3, "aggregate-train", "master", False, "merge rank chunks into all.parquet and stats"),
    PhaseSpec(4, "train-files-ready", "all", True, "aggregated train rollouts are published; eval decided"),
    PhaseSpec(5, "eval", "all", False, "eval iterations: each rank rolls out its share of the eval tasks"),
    PhaseSpec(6, "aggregate-eval", "all", True, "the master merges eval rollouts into accuracy metrics"),
    PhaseSpec(7, "stop-inference", "all", True, "stop or sleep the inference engine, free the accelerator"),
    PhaseSpec(8, "prepare-training-data", "master", False, "advantages, filtering, packing, training plan"),
    PhaseSpec(9, "training-ready", "all", True, "GO carries the rendezvous endpoint, port and attempt"),
    PhaseSpec(10, "train", "all", True, "the resident trainer (or one torchrun) trains on all nodes; a failed attempt is retried"),
    PhaseSpec(11, "publish-checkpoint", "master", False, "checkpoint folder renamed into place, then LATEST"),
    PhaseSpec(12, "restart-inference", "all", False, "serve the new checkpoint (restart, reload or wake)"),
    PhaseSpec(13, "iteration-done", "all", True, "metrics of the iteration written"),
)

BY_NUMBER = {p.number: p for p in PHASES}

JOB_PHASES: dict[str, tuple[int, ...]] = {
    "both": tuple(range(0, 14)),
    "rollout": tuple(range(0, 7)),
    "update": tuple(range(7, 14)),
    "eval": (0, 5, 6),  # --rl-phase rollout --rollout-split eval-only: evaluates each new checkpoint
    "bench": (0, 9, 10),  # run.sh --bench: join, rendezvous, one torchrun of the trainer's benchmark
}


def phases_of(job: str) -> list[PhaseSpec]:
    return [BY_NUMBER[n] for n in JOB_PHASES[job]]


def phase_name(number: int | None) -> str:
    spec = BY_NUMBER.get(number) if number is not None else None
    return spec.name if spec else "-"
