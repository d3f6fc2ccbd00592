"""The job kinds of a run as data (docs/design.md §6): what each trains, evaluates, serves and
waits for. The driver, the dry run and the CLI read these fields instead of comparing job names.

`both` is one job that does everything. A pipelined run is a `rollout` job and an `update` job
on one log path (plus, optionally, an `eval` job); they meet only in rollouts/ and checkpoints/.
`bench` is no RL job at all: one multi-node torchrun of the trainer's benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from coordination.phases import JOB_PHASES


@dataclass(frozen=True)
class JobKind:
    name: str
    rolls_out: bool  # samples the train rollouts of each iteration (phases 1-4)
    evaluates: bool  # evaluates a checkpoint on eval iterations (phases 5-6)
    trains: bool     # runs torchrun (phases 7-12; bench: 9-10)
    serves: bool     # keeps an inference engine
    # The other job of a pipelined run this one waits for: "checkpoint" (its master waits at phase 0
    # for LATEST, then tells every rank which policy to sample from), "rollouts" (at phase 7).
    waits_for: Literal["", "checkpoint", "rollouts"]
    # The policy its rollouts sample from: the checkpoint of the previous iteration, or LATEST up to
    # run.max_staleness iterations behind.
    policy: Literal["", "previous", "latest"]

    @property
    def phases(self) -> tuple[int, ...]:
        return JOB_PHASES[self.name]

    @property
    def only_evaluates(self) -> bool:
        """An eval job: it reads its eval tasks whatever run.eval_interval says."""
        return self.evaluates and not (self.rolls_out or self.trains)


BOTH = JobKind("both", rolls_out=True, evaluates=True, trains=True, serves=True, waits_for="", policy="previous")
ROLLOUT = JobKind("rollout", rolls_out=True, evaluates=False, trains=False, serves=True, waits_for="checkpoint",
                  policy="latest")
UPDATE = JobKind("update", rolls_out=False, evaluates=False, trains=True, serves=False, waits_for="rollouts",
                 policy="")
EVAL = JobKind("eval", rolls_out=False, evaluates=True, trains=False, serves=True, waits_for="checkpoint",
               policy="previous")
BENCH = JobKind("bench", rolls_out=False, evaluates=False, trains=True, serves=False, waits_for="", policy="")

KINDS: dict[str, JobKind] = {k.name: k for k in (BOTH, ROLLOUT, UPDATE, EVAL, BENCH)}
