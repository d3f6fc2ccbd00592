"""What the driver does with the inference engine between iterations
(inference.between_iterations: restart | reload | sleep)."""
from __future__ import annotations

from pathlib import Path

import pytest

from coordination.config import load
from rl.driver import RLJob
from coordination.layout import RunLayout
from rl.args import RunArgs
from rl.jobs import BOTH
from rl.runconfig import RunConfig
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

    def sleep(self, *, new_weights=False):
        self.calls.append(("sleep", "new weights next" if new_weights else ""))  # keeps serving state, like /sleep

    def wake(self, model_dir):
        self.calls.append(("wake", Path(model_dir).name))
        self.model_dir = Path(model_dir)

    def generate(self, prompts, n, sampling):
        raise AssertionError("not used here")


class FakeNode:
    def __init__(self, root: Path):
        self.layout = RunLayout(root)
        self.job = self.layout.job("both")
        self.rank = 0
        self.is_master = True

    def say(self, *a, **k):
        pass


@pytest.mark.parametrize("mode,expected", [
    ("restart", [("start", "iter-0"), ("stop", ""), ("start", "iter-1")]),
    ("reload", [("start", "iter-0"), ("reload", "iter-1")]),
    ("sleep", [("start", "iter-0"), ("sleep", "new weights next"), ("wake", "iter-1")]),
])
def test_engine_between_iterations(monkeypatch, tmp_path, mode, expected):
    cfg = load(RunConfig, [], [f"inference.between_iterations={mode}", "model.path=/m", "run.max_iterations=3"])
    args = RunArgs(Path("/d"), tmp_path, BOTH, 1, 1, [1.0], 0)
    job = RLJob(args, cfg, FakeNode(tmp_path))
    engine = RecordingEngine()
    monkeypatch.setattr("rollout.engines.make_engine", lambda *a, **k: engine)
    monkeypatch.setattr(RLJob, "policy", lambda self, it: (it, Path(f"/ckpt/iter-{it}")))
    job.engines.ensure(0, Path("/ckpt/iter-0"))                     # phases 1/5 of iteration 1
    step = Step(None, 1, BY_NUMBER[7], 1, {})
    job.stop_inference(step)                                        # phase 7
    job.restart_inference(Step(None, 1, BY_NUMBER[12], 1, {}))       # phase 12
    job.engines.ensure(1, Path("/ckpt/iter-1"))                     # phase 1 of iteration 2: nothing more
    assert engine.calls == expected
    assert job.engines.served == 1


class AdapterRecordingEngine(RecordingEngine):
    """Also records set_adapter; start/reload/wake serve the weights alone, as the Engine contract says."""

    def start(self, model_dir):
        super().start(model_dir)
        self.adapter_dir = None

    def reload(self, model_dir):
        super().reload(model_dir)
        self.adapter_dir = None

    def wake(self, model_dir):
        super().wake(model_dir)
        self.adapter_dir = None

    def set_adapter(self, adapter_dir):
        self.calls.append(("adapter", Path(adapter_dir).parent.name if adapter_dir else ""))
        self.adapter_dir = adapter_dir


@pytest.mark.parametrize("mode,expected", [
    ("restart", [("start", "base"), ("adapter", ""), ("stop", ""), ("start", "base"), ("adapter", "iter-1"),
                 ("stop", ""), ("start", "base"), ("adapter", "iter-2")]),
    ("reload", [("start", "base"), ("adapter", ""), ("adapter", "iter-1"), ("adapter", "iter-2")]),
    # the base weights stay: the sleep keeps them (the configured level), the wake swaps the adapter
    ("sleep", [("start", "base"), ("adapter", ""), ("sleep", ""), ("wake", "base"), ("adapter", "iter-1"),
               ("sleep", ""), ("wake", "base"), ("adapter", "iter-2")]),
])
def test_adapters_only_checkpoints_are_served_as_the_base_plus_their_adapter(monkeypatch, tmp_path, mode, expected):
    from coordination.records import publish_record

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    folders = {0: base}
    for it in (1, 2):  # what the trainer publishes with train.lora.publish=adapters: no config.json
        folders[it] = tmp_path / "checkpoints" / f"iter-{it}"
        (folders[it] / "adapter").mkdir(parents=True)
        publish_record(folders[it] / "trainer_state.json", "trainer-state",
                       {"lora": {"rank": 4, "publish": "adapters", "base": str(base)}}, run_id="r", generation=0)
    cfg = load(RunConfig, [], [f"inference.between_iterations={mode}", f"model.path={base}", "run.max_iterations=3",
                               "train.lora.rank=4", "train.lora.publish=adapters"])
    args = RunArgs(Path("/d"), tmp_path, BOTH, 1, 1, [1.0], 0)
    job = RLJob(args, cfg, FakeNode(tmp_path))
    engine = AdapterRecordingEngine()
    monkeypatch.setattr("rollout.engines.make_engine", lambda *a, **k: engine)
    monkeypatch.setattr(RLJob, "policy", lambda self, it: (it, folders[it]))
    job.engines.ensure(0, base)
    for it in (1, 2):
        job.stop_inference(Step(None, it, BY_NUMBER[7], 1, {}))
        job.restart_inference(Step(None, it, BY_NUMBER[12], 1, {}))
        job.engines.ensure(it, folders[it])                        # phase 1 of the next iteration: nothing more
    assert engine.calls == expected
    assert job.engines.served == 2 and engine.adapter_dir == folders[2] / "adapter"
