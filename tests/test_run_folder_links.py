"""Links planted where a library writes (W&B, TensorBoard) or where `status`, `report` and `stop`
read: refused with the one line that names the link, before anything is written or read through
it; and a W&B run leaves nothing outside the run folder and no link inside it. Every test compares
the folder outside the run before and after."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordination import sinks, timeline
from coordination.heartbeat import KIND as HEARTBEAT
from coordination.layout import LinkInRunFolder, RunLayout
from coordination.records import create_record, publish_record
from rl.runconfig import LoggingSection, WandbSection
from tests.procs import ROOT, env
from tests.test_run_folder_integrity import RUN, _plant, _run, tree_state, victim  # noqa: F401 - victim: fixture

BOTH_SINKS = LoggingSection(tensorboard=True, wandb=WandbSection(mode="offline"))
WANDB_VARS = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")


@pytest.fixture
def wandb_env(monkeypatch):
    """Whatever the sinks put into os.environ is undone after the test."""
    for name in WANDB_VARS:
        monkeypatch.delenv(name, raising=False)
    sinks._prepared.clear()
    yield
    sinks._prepared.clear()


def _symlink(to: str):
    def plant(link: Path, victim: Path) -> None:
        _plant(link, (victim / to).resolve())
    return plant


def _hard_link(to: str):
    def plant(link: Path, victim: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        os.link(victim / to, link)
    return plant


# Every folder W&B and TensorBoard use, and files in them by names a library picks itself (so
# baton cannot open them with its own checks): what is planted there, and how.
SINK_LINKS = {
    "wandb": _symlink("."),
    "wandb/wandb": _symlink("."),
    "wandb/cache": _symlink("."),
    "wandb/cache/wandb/logs": _symlink("."),
    "wandb/config": _symlink("."),
    "wandb/data": _symlink("."),
    "wandb/artifacts": _symlink("."),
    "wandb/wandb/offline-run-1-x/logs/debug-core.log": _symlink("driver.log"),  # copied from another run
    "wandb/wandb/offline-run-1-x/logs/debug-internal.log": _hard_link("driver.log"),
    "tensorboard": _symlink("."),
    "tensorboard/events.out.tfevents.1.host": _symlink("precious.txt"),
    "tensorboard/events.out.tfevents.2.host": _hard_link("precious.txt"),
}


@pytest.mark.parametrize("rel", sorted(SINK_LINKS))
def test_the_sinks_refuse_a_planted_link_before_they_start(tmp_path, victim, wandb_env, rel):
    lay = _run(tmp_path / "run")
    SINK_LINKS[rel](lay.root / rel, victim)
    with pytest.raises(LinkInRunFolder) as err:
        sinks.start(BOTH_SINKS, lay)
    assert str(err.value).startswith(f"{lay.root / rel} is a "), err.value  # names exactly what was planted
    assert sinks._background is None, "a sink was queued although its folder holds a link"
    assert not any(name in os.environ for name in WANDB_VARS)


def test_the_core_log_link_a_crashed_wandb_run_left_is_replaced_by_its_log(tmp_path, wandb_env):
    """W&B's service links each W&B run's logs/debug-core.log to its own log (in the cache folder
    baton points into the run); a node killed before the sinks closed leaves that link. The next
    start moves the log over its link instead of refusing its own run."""
    lay = _run(tmp_path / "run")
    core_log = lay.wandb_core_logs_dir / "core-debug-20260101_000000.log"
    core_log.parent.mkdir(parents=True)
    core_log.write_bytes(b"core log of the killed node\n")
    link = lay.wandb_runs_dir / "offline-run-20260101_000000-abc" / "logs" / "debug-core.log"
    _plant(link, core_log.absolute())
    sinks.prepare_folders(BOTH_SINKS, lay)
    assert not link.is_symlink() and link.read_bytes() == b"core log of the killed node\n"
    assert not core_log.exists()
    assert {name: os.environ[name] for name in WANDB_VARS} == {
        name: str(folder.absolute()) for name, folder in lay.wandb_folders().items()}
    assert all(str(lay.wandb_dir.absolute()) in os.environ[name] for name in WANDB_VARS)


_WANDB_RUN = """
import sys
from pathlib import Path
from coordination import sinks
from coordination.layout import RunLayout
from coordination.records import restrict_umask
from rl.runconfig import LoggingSection, WandbSection
restrict_umask()
cfg = LoggingSection(wandb=WandbSection(mode="offline"))
layout = RunLayout(Path(sys.argv[1]))
sinks.start(cfg, layout)
for it in (1, 2):
    sinks.emit(cfg, layout, {"iteration": it, "loss": 1.0 / it})
sinks.close()
"""


def _links_in(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if p.is_symlink()]


def test_a_wandb_run_writes_only_inside_the_run_folder_and_leaves_no_link(tmp_path):
    """A user's home, XDG cache and config, and a WANDB_CACHE_DIR of their own, get nothing: W&B's
    cache, config, data and artifact folders are the run's, and its core log is moved over the
    link W&B made to it. Run twice: the second start meets the first W&B run's files."""
    outside = {name: tmp_path / name for name in ("home", "xdg-cache", "xdg-config", "user-wandb-cache", "cwd")}
    for folder in outside.values():
        folder.mkdir()
    run = tmp_path / "run"
    child_env = env(HOME=str(outside["home"]), XDG_CACHE_HOME=str(outside["xdg-cache"]),
                    XDG_CONFIG_HOME=str(outside["xdg-config"]), WANDB_CACHE_DIR=str(outside["user-wandb-cache"]),
                    WANDB_SILENT="true")
    for attempt in (1, 2):
        res = subprocess.run([sys.executable, "-c", _WANDB_RUN, str(run)], cwd=outside["cwd"], env=child_env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "metric sink" not in res.stderr, res.stderr  # the sinks' thread met no error
        assert _links_in(run) == [], f"attempt {attempt}: links left in the run folder"
    for name, folder in outside.items():
        assert list(folder.rglob("*")) == [], f"W&B wrote into {name}: {list(folder.rglob('*'))}"
    lay = RunLayout(run)
    runs = sorted(lay.wandb_runs_dir.glob("offline-run-*"))
    assert len(runs) == 2 and all(len(list(r.glob("run-*.wandb"))) == 1 for r in runs)
    assert all(stat.S_ISREG((r / "logs" / "debug-core.log").lstat().st_mode) for r in runs)


# -- status, report and stop ------------------------------------------------------------------------

def _observable_run(root: Path) -> RunLayout:
    """A one-node run as status, report and stop read it: run, config, job, claim, heartbeat,
    progress, metrics and both timelines."""
    lay = _run(root)
    lay.config_yaml.write_text("coordination:\n  heartbeat_interval: 0.2\n  peer_timeout: 2.0\n")
    job = lay.job("both")
    create_record(job.job_json, "job", {"num_nodes": 1, "rank_weights": [1]}, run_id=RUN, generation=0)
    create_record(job.claim(0, 1), "claim", {"host": "node-a", "pid": 1}, run_id=RUN, generation=1)
    publish_record(job.heartbeat(0), HEARTBEAT, {"counter": 3, "nonce": "x", "state": "running", "phase": 1,
                                                 "iteration": 1, "message": "rolling out", "wall": time.time()},
                   run_id=RUN, generation=1)
    publish_record(job.progress_json, "progress", {"completed_iteration": 1, "stopped": None}, run_id=RUN,
                   generation=1)
    publish_record(lay.metrics(1), "metrics", {"loss": 1.0, "train_reward_mean": 0.5}, run_id=RUN, generation=0)
    for event in ("start", "end"):
        timeline.append(job.timeline(0), {"event": event, "job": "both", "rank": 0, "iteration": 1, "phase": 1,
                                          "wall": 100.0 + (event == "end")})
    timeline.append(job.trainer_timeline(0), {"event": "training", "job": "both", "rank": 0, "wall": 100.0})
    return lay


# (command, what is planted: its own bytes moved outside the run and a symbolic link left in
# their place, so that reading through the link would work and only the refusal stops it)
COMMAND_LINKS = [
    ("status", "run.json"), ("status", "config.yaml"), ("status", "jobs/both/job.json"),
    ("status", "jobs/both/nodes/rank-0/heartbeat.json"), ("status", "metrics"),
    ("report", "run.json"), ("report", "metrics"), ("report", "timeline"),
    ("report", "timeline/both-rank-0.jsonl"), ("report", "timeline/trainer/both-rank-0.jsonl"),
    ("stop", "run.json"), ("stop", "jobs/both/progress.json"), ("stop", "STOP"),
]


@pytest.mark.parametrize("command, rel", COMMAND_LINKS, ids=[f"{c}:{r}" for c, r in COMMAND_LINKS])
def test_status_report_and_stop_answer_a_planted_link_with_one_line(tmp_path, command, rel):
    lay = _observable_run(tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = lay.root / rel
    if planted.exists():
        shutil.move(planted, outside / planted.name)
    else:
        (outside / planted.name).write_bytes(b"not a stop request\n")
    planted.symlink_to(outside / planted.name)
    before = tree_state(outside)
    res = subprocess.run([sys.executable, "-m", "coordination", command, "--log-path", str(lay.root)], cwd=ROOT,
                         env=env(), capture_output=True, text=True, timeout=60)
    lines = [line for line in res.stderr.splitlines() if not line.startswith("watching heartbeats")]
    assert res.returncode == 1, res.stdout + res.stderr  # what `recover` exits with for a planted link
    assert len(lines) == 1 and lines[0].startswith(f"Error: {planted} is a symbolic link"), res.stderr
    assert tree_state(outside) == before
    assert not (lay.report_dir / "summary.md").exists()


# -- on real nodes (scripts/run.sh, tiny model) ------------------------------------------------------

@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from tests.e2e import make_assets

    return make_assets(tmp_path_factory.mktemp("e2e-assets"))


def _node(procs, name: str, assets, log: Path, outside: Path) -> None:
    """A one-node run of one iteration with W&B offline, in a home of its own under `outside`."""
    from tests.e2e import node_cmd

    data, model = assets
    for folder in ("home", "xdg-cache"):
        (outside / folder).mkdir(parents=True, exist_ok=True)
    procs.start(name, node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "0",
                               overrides=("run.max_iterations=1", "logging.wandb.mode=offline")),
                env=env(HOME=str(outside / "home"), XDG_CACHE_HOME=str(outside / "xdg-cache"), WANDB_SILENT="true"))


@pytest.mark.slow
def test_a_node_with_wandb_writes_nothing_outside_its_run_and_a_restart_refuses_a_planted_wandb_wandb(
        procs, tmp_path, assets, victim):
    """A finished one-node run: W&B's files all in the run folder, none in the node's home or cache,
    no link left. Then wandb/wandb is a link to a folder outside: the restart (which opens the
    sinks before it finds the run finished) stops with the one line naming it, exit 3."""
    from tests.e2e import fresh_log

    log, outside = fresh_log(tmp_path), tmp_path / "outside"
    lay = RunLayout(log)
    _node(procs, "node", assets, log, outside)
    assert procs.wait_all(400)["node"] == 0, procs.log("node")[-3000:]
    assert _links_in(log) == []
    assert [p for p in outside.rglob("*") if not p.is_dir()] == []
    assert len(list(lay.wandb_runs_dir.glob("offline-run-*/run-*.wandb"))) == 1
    shutil.move(lay.wandb_runs_dir, tmp_path / "first-wandb-runs")
    _plant(lay.wandb_runs_dir, victim)
    _node(procs, "restart", assets, log, outside)
    assert procs.wait("restart", 120) == 3, procs.log("restart")[-3000:]
    out = procs.log("restart")
    assert f"{lay.wandb_runs_dir} is a symbolic link" in out and "Traceback" not in out, out[-3000:]


def test_a_node_polling_for_stop_refuses_a_stop_file_that_is_a_link(tmp_path):
    """The nodes ask between waits whether STOP exists; `stop.sh` only ever writes a plain file,
    so a link named STOP was planted: the poll refuses it naming the link instead of stopping the
    run because of whatever file it points at (a link to a missing file is refused the same way)."""
    from rl.driver import _stop_requested

    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir()
    poll = _stop_requested(layout)
    assert poll() is None
    outside = tmp_path / "outside.txt"
    outside.write_text("not a stop request")
    for target in (outside, tmp_path / "missing"):
        layout.stop_file.symlink_to(target)
        with pytest.raises(LinkInRunFolder, match="STOP is a symbolic link"):
            poll()
        layout.stop_file.unlink()
    assert outside.read_text() == "not a stop request"
    layout.stop_file.write_text("stop")
    assert poll() == f"a stop was requested ({layout.stop_file})"
