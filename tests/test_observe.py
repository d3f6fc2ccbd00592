"""Seeing the run (issue 6): report, metric sinks, dry run."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from coordination import sinks, timeline
from coordination.layout import RunLayout
from coordination.records import create_record, publish_record
from coordination.report import make_report
from tests.e2e import make_assets
from tests.procs import ROOT, env

RUN = "r-observe"


def _fixture_metrics(root: Path) -> RunLayout:
    lay = RunLayout(root)
    create_record(lay.run_json, "run", {"config_hash": "x", "created_by": "t"}, run_id=RUN, generation=0)
    t0 = 1_700_000_000.0
    for it in (1, 2, 3):
        rec = {"iteration": it, "train_reward_mean": 0.2 * it, "eval_accuracy": 0.25 + 0.05 * it,
               "loss": 0.5 / it, "entropy": 1.0 - 0.1 * it,
               "rollout_tokens_per_s": {"0": 900.0 + it, "1": 450.0 + it},
               "phase_seconds": {"0": {"01-train-rollout": {"work": 3.0, "wait": 0.0},
                                       "10-train": {"work": 12.5, "wait": 0.1}},
                                 "1": {"01-train-rollout": {"work": 4.0, "wait": 0.0}}}}
        publish_record(lay.metrics(it), "metrics", rec, run_id=RUN, generation=1)
        for rank in (0, 1):
            base = t0 + 30 * (it - 1)
            for ph, start, end in ((1, 0, 3 + rank), (2, 3 + rank, 4.5)):
                timeline.append(lay.job("both").timeline(rank), {"job": "both", "rank": rank, "iteration": it,
                                "phase": ph, "name": "x", "attempt": 1, "event": "start", "wall": base + start})
                timeline.append(lay.job("both").timeline(rank), {"job": "both", "rank": rank, "iteration": it,
                                "phase": ph, "name": "x", "attempt": 1, "event": "end", "wall": base + end})
    return lay


def test_report_writes_readable_pngs_and_a_summary_with_the_metrics_numbers(tmp_path):
    import matplotlib.image as mpimg

    lay = _fixture_metrics(tmp_path / "run")
    res = make_report(lay.root, tmp_path / "out")
    names = sorted(Path(p).name for p in res["pngs"])
    assert names == ["learning.png", "loss.png", "throughput.png", "timeline.png"]
    for p in res["pngs"]:
        img = mpimg.imread(p)
        assert img.shape[0] >= 400 and img.shape[1] >= 800, (p, img.shape)
        assert img[..., :3].std() > 0.01, f"{p} is blank"
    md = Path(res["summary"]).read_text()
    assert "| 2 | 0.400 | 0.350 (1) | 0.2500 | 4.0 | - | 12.5 |" in md
    assert "Eval accuracy: 0.300 (checkpoint 0) -> 0.400 (checkpoint 2), +10.0 points." in md
    assert [r["eval_accuracy"] for r in res["rows"]] == pytest.approx([0.30, 0.35, 0.40])


def test_timeline_splits_each_iteration_into_work_coordination_and_waiting(tmp_path):
    """Per iteration of the fixture: rank 0 works 3 s (phase 1) and coordinates 1.5 s (phase 2's
    action); rank 1 works 4 s, coordinates 0.5 s and waits 1 s at the barrier. The coordination
    share is the non-work phases' seconds over all rank-seconds: 2 / 10."""
    lay = _fixture_metrics(tmp_path / "run")
    t0 = 1_700_000_000.0
    for it in (1, 2, 3):
        for event, at in (("wait-start", 4.5), ("wait-end", 5.5)):
            timeline.append(lay.job("both").timeline(1), {"job": "both", "rank": 1, "iteration": it, "phase": 2,
                            "name": "x", "attempt": 1, "event": event, "wall": t0 + 30 * (it - 1) + at})
    res = make_report(lay.root, tmp_path / "out")
    assert list(res["iterations"]) == [1, 2, 3]
    for split in res["iterations"].values():
        assert split["work"] == pytest.approx(7.0) and split["coordination"] == pytest.approx(2.0)
        assert split["waiting"] == pytest.approx(1.0)
        assert split["coordination_share"] == pytest.approx(0.2)


def test_the_resident_trainer_gets_a_lane_of_its_states_under_its_node(tmp_path):
    """State changes from the trainer's timeline become spans (a state lasts until the next one; the
    last until the run's phases end); idle is not drawn; the timeline gains one lane per trainer."""
    import matplotlib.image as mpimg

    from coordination.report import load_spans, load_trainer_spans, plot_timeline

    lay = _fixture_metrics(tmp_path / "run")
    t0 = 1_700_000_000.0
    for state, at, it in (("idle", 0.5, None), ("loading", 0.6, 1), ("idle", 2.0, None), ("training", 3.5, 1),
                          ("offloaded", 4.0, 1), ("training", 33.5, 2), ("offloaded", 34.0, 2)):
        timeline.append(lay.job("both").trainer_timeline(0), {"job": "both", "rank": 0, "launch": "L", "event": state,
                                                            "iteration": it, "wall": t0 + at})
    spans = load_spans(lay)
    end = max(s["end"] for s in spans)
    got = load_trainer_spans(lay, end=end)
    assert [(s["state"], s["iteration"], round(s["start"] - t0, 3), round(s["end"] - t0, 3)) for s in got] == [
        ("loading", 1, 0.6, 2.0), ("training", 1, 3.5, 4.0), ("offloaded", 1, 4.0, 33.5),
        ("training", 2, 33.5, 34.0), ("offloaded", 2, 34.0, round(end - t0, 3))]
    assert [s["state"] for s in load_trainer_spans(lay)][-1] == "training"  # no end: the open state is left out
    with_lane = mpimg.imread(plot_timeline(spans, tmp_path / "a", got))
    without = mpimg.imread(plot_timeline(spans, tmp_path / "b"))
    assert with_lane.shape[0] > without.shape[0]   # one more lane: the figure grows with its lanes


class TensorBoardOnly:
    """The `logging` config the sink tests use: TensorBoard on, W&B off."""

    tensorboard = True

    class wandb:
        mode = "disabled"


def test_tensorboard_event_files_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lay = RunLayout(tmp_path)

    try:
        for it in (1, 2):
            sinks.emit(TensorBoardOnly, lay, {"iteration": it, "eval_accuracy": 0.1 * it, "loss": 1.0 / it,
                                  "rollout_tokens_per_s": {"0": 100.0 * it},
                                  "phase_seconds": {"1": {"10-train": {"work": 5.0, "wait": 1.0}}}})
    finally:
        sinks.close()
    acc = EventAccumulator(str(lay.tensorboard_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"run/eval_accuracy", "run/loss", "rollout_tokens_per_s/rank0", "phase_work_s/rank1/10-train"} <= set(tags)
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("run/eval_accuracy")] == [(1, 0.1), (2, 0.2)]


def test_dry_run_prints_plan_split_and_commands_and_writes_nothing(tmp_path):
    data, model = make_assets(tmp_path / "assets")
    log = tmp_path / "run"
    cmd = [str(ROOT / "scripts/run.sh"), "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both",
           "--eval-interval", "2", "--num-nodes", "3", "--rank-weights", "2,1,1", "--worker", "2", "--dry-run",
           f"model.path={model}", "tasks.tasks_per_iteration=40", "inference.engine=vllm",
           "inference.vllm.python=/opt/vllm/bin/python"]
    before = sorted(p for p in tmp_path.rglob("*"))
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "tasks_per_iteration: 40" in out                              # the resolved config
    assert "10 train" in out and "barrier" in out                       # the phase plan
    assert "train rank 0: 20 tasks" in out and "train rank 2: 10 tasks <- this node" in out
    assert "/opt/vllm/bin/python -m vllm.entrypoints.cli.main serve " in out
    assert "-m torch.distributed.run --nnodes 3" in out and "--rdzv-conf is_host=0" in out
    assert not log.exists() and sorted(p for p in tmp_path.rglob("*")) == before


def test_training_progress_follows_the_trainer_log(tmp_path, caplog):
    import logging

    from rl.driver import StepProgress

    said = []

    class FakeNode:
        def say(self, message, **kw):
            said.append(message)

    log = tmp_path / "trainer.log"
    log.write_text("older attempt: iter 1 step 9/9 (ignored: before this attempt started)\n")
    p = StepProgress(log, "train iter 2", FakeNode())
    with open(log, "a") as fh:
        fh.write("04:08:49 [train rank0] INFO baton.train.trainer: iter 2 step 1/4 (optimizer step 5) loss 0.1\n")
        fh.write("04:08:50 [train rank0] INFO baton.train.trainer: iter 2 step 2/4 (optim")  # half a line
    with caplog.at_level(logging.INFO, logger="baton.progress"):
        p.update()
        assert p.done == 1 and said[-1] == "train iter 2: step 1/4"
        with open(log, "a") as fh:
            fh.write("izer step 6) loss 0.2\n... iter 2 step 4/4 (optimizer step 8) loss 0.1\n")
        p.close()
    assert p.done == 4 and said[-1] == "train iter 2: step 4/4"
    assert any("train iter 2: 4/4 steps" in r.getMessage() for r in caplog.records)


def test_dry_run_refuses_what_a_start_would_refuse_after_showing_the_plan(tmp_path):
    """A task file with fewer tasks than tasks_per_iteration is refused at join (exit 2); a dry run
    says so too, and still prints the rest, so one dry run shows every problem."""
    data, model = make_assets(tmp_path / "assets")
    n_train = sum(1 for _ in (data / "train.jsonl").open())
    log = tmp_path / "run"
    cmd = [str(ROOT / "scripts/run.sh"), "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both",
           "--eval-interval", "0", "--dry-run", f"model.path={model}", f"tasks.tasks_per_iteration={n_train + 1}"]
    before = sorted(p for p in tmp_path.rglob("*"))
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "## phase plan of this rank" in res.stdout and "## commands this node would run" in res.stdout
    refused = [line for line in res.stdout.splitlines() if line.strip().startswith("refused:")]
    assert len(refused) == 1 and str(n_train + 1) in refused[0] and str(data / "train.jsonl") in refused[0]
    assert "a start with this command would stop here (exit 2)" in res.stderr
    assert not log.exists() and sorted(p for p in tmp_path.rglob("*")) == before
    ok = subprocess.run(cmd[:-1] + [f"tasks.tasks_per_iteration={n_train}"], env=env(), capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "refused:" not in ok.stdout, ok.stdout + ok.stderr


def _recorded_run(tmp_path: Path, *, completed: int, stopped: str | None) -> tuple[Path, Path, Path, list[str]]:
    """A run folder as a finished (or interrupted) run leaves it: run.json, config.yaml of the
    command `overrides` with run.max_iterations=12, the job's progress and rank 1's heartbeat."""
    import yaml

    from coordination.config import to_dict
    from rl.runconfig import load_run_config

    data, model = make_assets(tmp_path / "assets")
    log = tmp_path / "run"
    overrides = [f"model.path={model}", "tasks.tasks_per_iteration=40"]
    cfg = load_run_config([], [f"run.data_path={data}", "run.eval_interval=1", "run.max_iterations=12", *overrides])
    lay = RunLayout(log)
    create_record(lay.run_json, "run", {"config_hash": "h", "created_by": "t"}, run_id=RUN, generation=0)
    lay.config_yaml.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    publish_record(lay.job("both").progress_json, "progress", {"completed_iteration": completed, "stopped": stopped},
                   run_id=RUN, generation=1)
    publish_record(lay.job("both").heartbeat(1), "heartbeat", {"iteration": completed + 1, "phase": 10,
                   "state": "running", "message": "train iter 6: step 2/4", "counter": 3, "nonce": "n"},
                   run_id=RUN, generation=1)
    return data, log, model, overrides


def _listing(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _dry_run(data: Path, log: Path, overrides: list[str]) -> str:
    """Worker 1's --dry-run on the recorded run: its output, after checking that it succeeded and
    left every file of the run as it was."""
    before = _listing(log)
    cmd = [str(ROOT / "scripts/run.sh"), "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both",
           "--eval-interval", "1", "--num-nodes", "2", "--rank-weights", "1,1", "--worker", "1", "--dry-run",
           *overrides]
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert _listing(log) == before
    return res.stdout


def test_dry_run_on_a_finished_run_says_it_is_finished_and_shows_config_differences(tmp_path):
    data, log, _, overrides = _recorded_run(tmp_path, completed=13, stopped="run.max_iterations (12) reached")
    out = _dry_run(data, log, [*overrides, "run.max_iterations=2"])
    assert "job both is finished: it stopped after iteration 13 (run.max_iterations (12) reached)" in out
    assert "differs from the recorded run in 1 key(s)" in out and "run.max_iterations: 12 -> 2" in out
    assert "next iteration" not in out and "iter-13" not in out      # no plan for a run that will not run


def test_dry_run_on_an_interrupted_run_says_where_this_rank_stands(tmp_path):
    data, log, _, overrides = _recorded_run(tmp_path, completed=5, stopped=None)
    out = _dry_run(data, log, [*overrides, "run.max_iterations=12"])
    assert "job both is at iteration 6; rank 1 last reported iteration 6, phase 10 train" in out
    assert "this command's config matches the recorded run" in out and "next iteration: 6" in out


def test_each_finished_iteration_is_one_console_line_with_reward_accuracy_and_seconds(caplog):
    import logging

    from coordination.barrier import Go
    from rl.driver import _say_iteration_done

    go = Go("continue", "", {"train_reward_mean": 0.5, "eval_accuracy": 0.375, "loss": None}, 1)
    with caplog.at_level(logging.INFO, logger="baton.driver"):
        _say_iteration_done(4, go, 12.34)
        _say_iteration_done(5, Go("stop", "done", {}, 1), 1.0)
    assert caplog.messages == ["iteration 4 done in 12.3 s: train reward 0.500, eval accuracy 0.375 (checkpoint 3)",
                               "iteration 5 done in 1.0 s"]


def test_report_skips_a_non_utf8_timeline_line_and_draws_the_rest(tmp_path, caplog):
    lay = _fixture_metrics(tmp_path / "run")
    tl = lay.job("both").timeline(1)
    with open(tl, "ab") as fh:
        fh.write(b'{"job": "both", "event": "\xff\xfe broken"}\n')
    events = list(timeline.read(tl))
    assert len(events) == 12 and all(isinstance(e, dict) for e in events)
    assert f"{tl}:13: skipped a damaged timeline line" in caplog.text
    res = make_report(lay.root, tmp_path / "out")
    assert any(Path(p).name == "timeline.png" for p in res["pngs"])


def test_sinks_write_in_the_background_so_emit_never_waits_for_a_slow_sink(tmp_path):
    """emit() only queues: a sink still busy (W&B starting, a slow filesystem) holds no phase up,
    and close() still writes every queued iteration before it returns."""
    import threading
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lay = RunLayout(tmp_path)

    release = threading.Event()
    try:
        sinks._worker().put(release.wait)  # the sink thread is busy until released
        started = time.monotonic()
        for it in (1, 2, 3):
            sinks.emit(TensorBoardOnly, lay, {"iteration": it, "loss": float(it)})
        assert time.monotonic() - started < 1.0
        assert not lay.tensorboard_dir.exists()  # nothing written while the sink is busy
        release.set()
    finally:
        release.set()
        sinks.close()
    acc = EventAccumulator(str(lay.tensorboard_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("run/loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_close_returns_within_its_timeout_when_a_sink_hangs(tmp_path, caplog):
    """A sink that never returns (W&B's finish() waiting on its service process) costs close() its
    timeout, not the end of the run: the writers are closed on the sinks' thread, and the master
    goes on to exit."""
    import threading
    import time

    lay = RunLayout(tmp_path)

    hang = threading.Event()
    try:
        sinks.emit(TensorBoardOnly, lay, {"iteration": 1, "loss": 1.0})
        assert sinks._worker().drain(60) and "tb" in sinks._writers  # TensorBoard opened and written
        sinks._worker().put(hang.wait)  # stands for a finish() that does not come back
        worker = sinks._background
        started = time.monotonic()
        sinks.close(timeout=0.5)
        elapsed = time.monotonic() - started
        assert 0.5 <= elapsed < 3.0
        assert "metric sinks did not finish within" in caplog.text
        assert sinks._background is None and worker.thread.is_alive()  # left behind, a daemon thread
        assert "tb" in sinks._writers  # its close is queued behind the hung task
    finally:
        hang.set()
    worker.thread.join(timeout=10)
    assert not worker.thread.is_alive() and "tb" not in sinks._writers  # closed on the sinks' thread, then it ended
