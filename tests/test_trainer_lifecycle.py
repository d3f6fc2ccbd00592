"""The trainer lifecycle's release rule (rl/training.py `check_released`): after an iteration whose
order asked the trainer to offload, the engine that shares its devices may wake or start only once
every local trainer rank has published "offloaded" for that iteration and launch. The records are
the real ones the trainer processes write (train.resident.Mailbox, train.results.write_result)."""
from __future__ import annotations

from pathlib import Path

import pytest

from coordination.config import load
from coordination.layout import RunLayout
from coordination.phases import BY_NUMBER, PhaseId
from coordination.runner import Step
from rl.args import RunArgs
from rl.jobs import BOTH
from rl.plan import job_plan
from rl.runconfig import RunConfig
from rl.training import TrainerLifecycle
from train.resident import Mailbox, ResidentTrainer
from train.results import write_result

LAUNCH, ITERATION = "run1-both-i1-a1", 2


class FakeNode:
    def __init__(self, root: Path):
        self.layout = RunLayout(root)
        self.job = self.layout.job("both")
        self.rank, self.is_master, self.generation, self.run_id = 0, True, 1, "run1"

    def say(self, *a, **k):
        pass


def _trained(tmp_path: Path, *over: str, beside_engine: bool = True) -> tuple[TrainerLifecycle, list[Mailbox]]:
    """A lifecycle whose two local trainer ranks wrote their results of iteration 2 (so its
    results() returns at once, as after a real attempt) and are still "training" in their state."""
    cfg = load(RunConfig, [], ["model.path=/m", "run.max_iterations=3", "train.nproc_per_node=2", *over])
    node = FakeNode(tmp_path)
    life = TrainerLifecycle(node, job_plan(RunArgs(Path("/d"), tmp_path, BOTH, 1, 1, [1.0], 0), cfg),
                            beside_engine=beside_engine)
    life.trainer = ResidentTrainer(node, life.log_file)
    life.trainer.launch_id = LAUNCH  # what launch() records; no process is needed once every result is written
    boxes = [Mailbox(node.job, 0, LAUNCH, run_id=node.run_id, local_rank=r) for r in (0, 1)]
    for r, box in enumerate(boxes):
        box.say("training", iteration=ITERATION)
        write_result(node.layout, ITERATION, 1, r, node.run_id, {"ok": True})
    life.results(Step(node, ITERATION, BY_NUMBER[PhaseId.TRAIN], 1, {}), on_tick=lambda: None)
    return life, boxes


def test_the_engine_may_not_wake_until_every_local_trainer_rank_said_it_released_the_devices(tmp_path):
    life, boxes = _trained(tmp_path)
    boxes[0].say("offloaded", iteration=ITERATION)
    with pytest.raises(RuntimeError, match=r"still holding: local rank 1: \('run1-both-i1-a1', 2, 'training'\)"):
        life.check_released(ITERATION)
    boxes[1].say("offloaded", iteration=ITERATION - 1)  # an older iteration's release does not count
    with pytest.raises(RuntimeError, match="local rank 1"):
        life.check_released(ITERATION)
    boxes[1].say("offloaded", iteration=ITERATION)
    life.check_released(ITERATION)


@pytest.mark.parametrize("over, beside_engine", [(("train.offload_between_iterations=false",), True),
                                                 ((), False)])
def test_no_release_is_required_where_none_was_ordered(tmp_path, over, beside_engine):
    life, _ = _trained(tmp_path, *over, beside_engine=beside_engine)
    life.check_released(ITERATION)  # both ranks still say "training": no offload was ordered
