"""The resident trainer's early launch (docs/design.md §9.6): which phase-0 GOs ask every node to
launch its trainer during the rollouts, and what a node does with such a GO. The whole path with
real processes is in tests/test_resident_trainer.py (the first order is the prepare order, phase
10 launches nothing, results equal torchrun per iteration; kill -9 during the early launch)."""
from __future__ import annotations

from pathlib import Path

import pytest

from coordination.barrier import Arrival, Go
from coordination.config import load, to_dict
from coordination.layout import RunLayout
from coordination.phases import BY_NUMBER, PhaseId
from coordination.runner import Step
from rl.args import RunArgs
from rl.driver import RLJob
from rl.payloads import SyncGo
from rl.jobs import BOTH, UPDATE
from rl.runconfig import RunConfig
from rl.training import TrainerLifecycle


class FakeNode:
    def __init__(self, root: Path, rank: int = 0, generation: int = 1):
        self.layout = RunLayout(root)
        self.job = self.layout.job("both")
        self.rank, self.is_master, self.generation, self.run_id = rank, rank == 0, generation, "run1"

    def say(self, *a, **k):
        pass


class RecordingTrainer:
    made: list["RecordingTrainer"] = []

    def __init__(self, node, log_file):
        self.launched, self.orders = [], []
        RecordingTrainer.made.append(self)

    def launch(self, cmd, env, launch_id):
        self.launched.append(launch_id)

    def order(self, **data):
        self.orders.append(data)


def _job(tmp_path, monkeypatch, *over: str, nodes: int = 2, rank: int = 0, generation: int = 1) -> RLJob:
    cfg = load(RunConfig, [], ["model.path=/m", "run.max_iterations=3", "run.eval_interval=1", *over])
    args = RunArgs(Path("/d"), tmp_path, BOTH, 1, nodes, [1.0] * nodes, rank)
    job = RLJob(args, cfg, FakeNode(tmp_path, rank, generation))
    monkeypatch.setattr(TrainerLifecycle, "rendezvous", lambda self, it, attempt, early=False:
                        {"addr": "10.0.0.1", "port": 29400, "attempt": attempt,
                         "rdzv_id": f"run1-both-i{it}-{'early' if early else f'a{attempt}'}"})
    monkeypatch.setattr(RLJob, "already_trained", lambda self, it: False)
    monkeypatch.setattr(RLJob, "policy", lambda self, it: (it, Path(f"/ckpt/iter-{it}")))
    return job


def _step(job: RLJob, iteration: int, gos=None) -> Step:
    return Step(job.node, iteration, BY_NUMBER[PhaseId.SYNC], 1, gos or {})


def _arrivals(*launches: str | None) -> dict[int, Arrival]:
    return {r: Arrival(r, 1, True, None, {"trainer": t}) for r, t in enumerate(launches)}


@pytest.mark.parametrize("launches, early", [
    ((None, None), True),                        # first iteration of the run: nobody has a trainer
    (("run1-both-i1-early", None), True),        # a node restarted: everyone launches anew
    (("run1-both-i1-a1", "run1-both-i1-a2"), True),
    (("run1-both-i1-early", "run1-both-i1-early"), False),  # both keep theirs
])
def test_phase0_go_asks_for_an_early_launch_unless_every_node_keeps_one_trainer(tmp_path, monkeypatch, launches, early):
    job = _job(tmp_path, monkeypatch)
    go = SyncGo.from_dict(job.decide0(_step(job, 2), _arrivals(*launches)).payload)
    assert (go.trainer is not None) == early
    if early:
        assert go.trainer["rdzv_id"] == "run1-both-i2-early"


def test_no_early_launch_where_phase_10_does_not_run_or_the_trainer_is_not_resident(tmp_path, monkeypatch):
    job = _job(tmp_path, monkeypatch)
    assert job.plan.is_final_eval(4)
    assert SyncGo.from_dict(job.decide0(_step(job, 4), _arrivals(None, None)).payload).trainer is None
    job = _job(tmp_path, monkeypatch, "train.resident=false")
    assert SyncGo.from_dict(job.decide0(_step(job, 1), _arrivals(None, None)).payload).trainer is None
    job = _job(tmp_path, monkeypatch)
    monkeypatch.setattr(RLJob, "already_trained", lambda self, it: True)
    assert SyncGo.from_dict(job.decide0(_step(job, 1), _arrivals(None, None)).payload).trainer is None


def _sync_go(job: RLJob, iteration: int, arrival_generation: int) -> dict[int, Go]:
    payload = SyncGo(trainer=job.trainers.rendezvous(iteration, 1, early=True)).to_dict()
    arrivals = {str(r): {"ok": True, "error": None, "generation": arrival_generation} for r in (0, 1)}
    return {PhaseId.SYNC: Go("continue", "", payload, 1, arrivals)}


@pytest.mark.parametrize("gpu, loads_early", [(False, True), (True, False)])
def test_a_node_launches_once_and_loads_early_only_without_a_gpu_the_engine_needs(tmp_path, monkeypatch, gpu,
                                                                                    loads_early):
    from train.data import model_inputs

    monkeypatch.setattr("rl.training.ResidentTrainer", RecordingTrainer)
    monkeypatch.setattr("rl.training.gpu_visible", lambda: gpu)
    job = _job(tmp_path, monkeypatch, rank=1)
    step = _step(job, 3, _sync_go(job, 3, arrival_generation=1))
    job.start_trainer_early(step)
    job.start_trainer_early(step)  # a later phase of the same iteration: nothing more
    trainer = RecordingTrainer.made[-1]
    assert trainer.launched == ["run1-both-i3-early"]
    if loads_early:
        # exactly what phase 8's plan will name, so phase 10 continues the model loaded now
        assert trainer.orders == [{"prepare": model_inputs(job.cfg.train, iteration=3, world_size=2,
                                                           input_checkpoint=Path("/ckpt/iter-2"), input_iteration=2)}]
        assert trainer.orders[0]["prepare"]["config"] == to_dict(job.cfg.train)
    else:
        assert trainer.orders == []


def test_an_update_job_loads_early_even_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr("rl.training.gpu_visible", lambda: True)
    cfg = load(RunConfig, [], ["model.path=/m", "run.max_iterations=3"])
    job = RLJob(RunArgs(Path("/d"), tmp_path, UPDATE, 1, 2, [1.0, 1.0], 0), cfg, FakeNode(tmp_path))
    assert not job.kind.serves and job.trainers.may_load_early()


def test_a_process_that_joined_after_the_go_launches_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("rl.training.ResidentTrainer", RecordingTrainer)
    job = _job(tmp_path, monkeypatch, rank=1, generation=2)
    made = len(RecordingTrainer.made)
    job.start_trainer_early(_step(job, 2, _sync_go(job, 2, arrival_generation=1)))
    assert len(RecordingTrainer.made) == made   # the GO's port may be gone with the old processes
    job.start_trainer_early(_step(job, 2))      # and a GO without a rendezvous launches nothing either
    assert len(RecordingTrainer.made) == made
