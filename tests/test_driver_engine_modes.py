"""What the driver does with the inference engine between iterations
(inference.between_iterations: restart | reload | sleep)."""
from __future__ import annotations

from pathlib import Path

import pytest

from coordination.config import load
from coordination.driver import RLJob
from coordination.layout import RunLayout
from coordination.run_cli import RunArgs
from coordination.runconfig import RunConfig
from coordination.runner import Step
from coordination.phases import BY_NUMBER
from rollout.engine import Engine


class RecordingEngine(Engine):
    name = "recording"

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def start(self, model_dir):
        self.calls.append(("start", Path(model_dir).name))
        self.model_dir = Path(model_dir)

    def stop(self):
        self.calls.append(("stop", ""))
        self.model_dir = None

    def reload(self, model_dir):
        self.calls.append(("reload", Path(model_dir).name))
        self.model_dir = Path(model_dir)

    def sleep(self):
        self.calls.append(("sleep", ""))  # keeps serving state, like vLLM's /sleep

    def wake(self, model_dir):
        self.calls.append(("wake", Path(model_dir).name))
        self.model_dir = Path(model_dir)

    def generate(self, prompts, n, sampling):
        raise AssertionError("not used here")


class FakeJob:
    def __init__(self, root):
        self.name = "both"
        self.root = root

    def logs_dir(self, rank):
        return self.root / "logs"


class FakeNode:
    def __init__(self, root: Path):
        self.layout = RunLayout(root)
        self.job = FakeJob(root)
        self.rank = 0
        self.is_master = True

    def say(self, *a, **k):
        pass


@pytest.mark.parametrize("mode,expected", [
    ("restart", [("start", "iter-0"), ("stop", ""), ("start", "iter-1")]),
    ("reload", [("start", "iter-0"), ("reload", "iter-1")]),
    ("sleep", [("start", "iter-0"), ("sleep", ""), ("wake", "iter-1")]),
])
def test_engine_between_iterations(monkeypatch, tmp_path, mode, expected):
    cfg = load(RunConfig, [], [f"inference.between_iterations={mode}", "model.path=/m", "run.max_iterations=3"])
    args = RunArgs(Path("/d"), tmp_path, "both", 1, None, 1, [1.0], 0)
    job = RLJob(args, cfg, FakeNode(tmp_path))
    engine = RecordingEngine()
    monkeypatch.setattr("rollout.inference.make_engine", lambda *a, **k: engine)
    monkeypatch.setattr(RLJob, "policy", lambda self, it: (it, Path(f"/ckpt/iter-{it}")))
    job.ensure_engine(0, Path("/ckpt/iter-0"))                      # phases 1/5 of iteration 1
    step = Step(None, 1, BY_NUMBER[7], 1, {})
    job.stop_inference(step)                                        # phase 7
    job.restart_inference(Step(None, 1, BY_NUMBER[12], 1, {}))       # phase 12
    job.ensure_engine(1, Path("/ckpt/iter-1"))                      # phase 1 of iteration 2: nothing more
    assert engine.calls == expected
    assert job.served == 1
