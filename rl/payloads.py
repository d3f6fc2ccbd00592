"""What the RL phases put in their arrivals and GOs (docs/design.md §6), as typed records.

Barrier files hold JSON objects; each record here says which phase carries it and converts to
and from that object, so the driver reads `SyncGo.of(step).policy_iteration` instead of
`step.go_payload(0)["policy_iteration"]`. Unknown keys are ignored and missing keys take the
field's default, so a GO written by an older driver still reads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar, TypeVar

from coordination.phases import PhaseId
from coordination.runner import Step

R = TypeVar("R", bound="Payload")


@dataclass(frozen=True)
class Payload:
    phase: ClassVar[PhaseId]  # the phase whose GO (or arrival) carries this record

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls: type[R], data: dict) -> R:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @classmethod
    def of(cls: type[R], step: Step) -> R:
        """The payload in the GO of `cls.phase` this iteration (defaults when that GO has none)."""
        return cls.from_dict(step.go_payload(cls.phase))


@dataclass(frozen=True)
class SyncGo(Payload):
    """Phase 0 GO: for a job that waits for checkpoints, the policy every rank samples from; with
    resident trainers and none alive on every node, `trainer`, the Rendezvous (as a dict) where
    every node launches its trainer now, so that it loads during the rollouts (docs/design.md §9.6)."""
    phase: ClassVar[PhaseId] = PhaseId.SYNC
    policy_iteration: int | None = None
    trainer: dict | None = None


@dataclass(frozen=True)
class RolloutDone(Payload):
    """Phase 1 / 5 arrival: what this rank's rollouts produced."""
    phase: ClassVar[PhaseId] = PhaseId.TRAIN_ROLLOUT
    tasks: int = 0
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    policy_iteration: int = 0


@dataclass(frozen=True)
class TrainAggregated(Payload):
    """Phase 3 arrival of the master: the headline numbers of the aggregated train rollouts."""
    phase: ClassVar[PhaseId] = PhaseId.AGGREGATE_TRAIN
    stats: dict = field(default_factory=dict)  # tasks, samples, reward_mean, pass_at_1

    @classmethod
    def brief(cls, stats: dict) -> "TrainAggregated":
        return cls({k: stats.get(k) for k in ("tasks", "samples", "reward_mean", "pass_at_1")})


@dataclass(frozen=True)
class EvalChoice(Payload):
    """Phase 4 GO: whether this iteration evaluates (phases 5 and 6 run)."""
    phase: ClassVar[PhaseId] = PhaseId.TRAIN_FILES_READY
    eval: bool = False


@dataclass(frozen=True)
class EvalResult(Payload):
    """Phase 6 GO: the eval accuracy the master aggregated."""
    phase: ClassVar[PhaseId] = PhaseId.AGGREGATE_EVAL
    eval_accuracy: float | None = None


@dataclass(frozen=True)
class IterationSummary(Payload):
    """Phase 13 GO: the numbers every node prints when the iteration ends."""
    phase: ClassVar[PhaseId] = PhaseId.ITERATION_DONE
    train_reward_mean: float | None = None
    eval_accuracy: float | None = None
    loss: float | None = None


@dataclass(frozen=True)
class Rendezvous(Payload):
    """Phase 9 GO (and the payload of a phase-10 retry): where this attempt's torchrun agents meet,
    or, with resident trainers (docs/design.md §9.6), `reuse`: the launch every node keeps serving."""
    phase: ClassVar[PhaseId] = PhaseId.TRAINING_READY
    addr: str = ""
    port: int = 0
    attempt: int = 1
    rdzv_id: str = ""
    reuse: str | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    @classmethod
    def for_attempt(cls, step: Step) -> "Rendezvous":
        """The rendezvous of `step`'s attempt: the retry's GO when this is a retry, else phase 9's."""
        return cls.from_dict(step.retry.payload) if step.retry is not None else cls.of(step)


@dataclass(frozen=True)
class TrainerReady(Payload):
    """Phase 0 and phase 9 arrival: the launch of this node's resident trainer, if one is alive."""
    phase: ClassVar[PhaseId] = PhaseId.TRAINING_READY
    trainer: str | None = None


@dataclass(frozen=True)
class Trained(Payload):
    """Phase 10 GO: the attempt whose staging folder phase 11 publishes."""
    phase: ClassVar[PhaseId] = PhaseId.TRAIN
    attempt: int = 1
