"""The job kinds of a run as data (docs/design.md §6): what each trains, evaluates, serves and
waits for, and which run.sh flags select it. The driver, the dry run, the CLI and the config
checks read these fields; no other module compares a job's name (tests/test_layers.py checks it),
so adding a job is adding a row here and in coordination.phases.JOB_PHASES.

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
    benchmarks: bool  # runs the trainer's benchmark once instead of RL iterations (BenchPlan, BenchJob)
    # The run.sh flags that select this job (kept as `rl_phase` and `rollout_split` in job.json).
    rl_phase: str  # --rl-phase; the benchmark's "bench" is only recorded (--bench selects it)
    rollout_split: str | None = None  # --rollout-split, which only --rl-phase rollout takes

    @property
    def phases(self) -> tuple[int, ...]:
        return JOB_PHASES[self.name]

    @property
    def only_evaluates(self) -> bool:
        """An eval job: it reads its eval tasks whatever run.eval_interval says."""
        return self.evaluates and not (self.rolls_out or self.trains)

    @property
    def evaluates_on_interval(self) -> bool:
        """Evaluates on the iterations run.eval_interval names, so run.sh wants --eval-interval."""
        return self.evaluates and not self.only_evaluates

    @property
    def flags(self) -> str:
        """The run.sh flags that start this job, for messages that tell the user what to run."""
        if self.benchmarks:
            return "--bench"
        return f"--rl-phase {self.rl_phase}" + (f" --rollout-split {self.rollout_split}" if self.rollout_split else "")


BOTH = JobKind("both", rolls_out=True, evaluates=True, trains=True, serves=True, waits_for="", policy="previous",
               benchmarks=False, rl_phase="both")
ROLLOUT = JobKind("rollout", rolls_out=True, evaluates=False, trains=False, serves=True, waits_for="checkpoint",
                  policy="latest", benchmarks=False, rl_phase="rollout", rollout_split="train-only")
UPDATE = JobKind("update", rolls_out=False, evaluates=False, trains=True, serves=False, waits_for="rollouts",
                 policy="", benchmarks=False, rl_phase="update")
EVAL = JobKind("eval", rolls_out=False, evaluates=True, trains=False, serves=True, waits_for="checkpoint",
               policy="previous", benchmarks=False, rl_phase="rollout", rollout_split="eval-only")
BENCH = JobKind("bench", rolls_out=False, evaluates=False, trains=True, serves=False, waits_for="", policy="",
                benchmarks=True, rl_phase="bench")

# In the order run.sh's help and messages list the --rl-phase values.
KINDS: dict[str, JobKind] = {k.name: k for k in (ROLLOUT, UPDATE, BOTH, EVAL, BENCH)}
# The values of --rl-phase (--rollout-split then picks among the jobs that share one).
RL_PHASES: tuple[str, ...] = tuple(dict.fromkeys(k.rl_phase for k in KINDS.values() if not k.benchmarks))
# The job a pipelined job waits for, whose master it watches (rl/pipeline.py).
PRODUCER: dict[str, JobKind] = {"checkpoint": UPDATE, "rollouts": ROLLOUT}


def kind_for(rl_phase: str | None, rollout_split: str | None, *, bench: bool) -> JobKind:
    """The job run.sh's flags select; ValueError naming the flag and the fix when they select none.
    (--bench beside RL flags is refused by the CLI before this, with the flag named.)"""
    if bench:
        return BENCH
    same_phase = [k for k in KINDS.values() if not k.benchmarks and k.rl_phase == rl_phase]
    if not same_phase:
        phases = "|".join(RL_PHASES)
        raise ValueError(f"--rl-phase {phases} is required (or --bench to benchmark the trainer)"
                         if rl_phase is None else f"--rl-phase must be one of {phases} (got {rl_phase!r})")
    for k in same_phase:
        if k.rollout_split == rollout_split:
            return k
    splits = [k.rollout_split for k in same_phase if k.rollout_split]
    if not splits:
        raise ValueError(f"--rollout-split only applies to --rl-phase "
                         f"{'|'.join(dict.fromkeys(k.rl_phase for k in KINDS.values() if k.rollout_split))} "
                         f"(got --rl-phase {rl_phase})")
    raise ValueError(f"--rollout-split {'|'.join(splits)} is required with --rl-phase {rl_phase}"
                     if rollout_split is None else
                     f"--rollout-split must be one of {'|'.join(splits)} with --rl-phase {rl_phase} "
                     f"(got {rollout_split!r})")
