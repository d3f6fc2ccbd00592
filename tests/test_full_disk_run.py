"""A full disk is a stop, not a crash: a real one-node run (scripts/run.sh, tiny model, resident
trainer) on a small tmpfs, filled to the byte at one point after another and freed again. At every
point the node exits 8 with one console line naming the errno, the path and what to free, no
traceback and no "--- Logging error ---" block; the traceback is in its log when the log can be
written; each restart with the same command resumes, and the finished run lost nothing.

One run serves every point (each restart resumes where the last stop left it), in phase order:
aggregation (iteration 1, phase 3; the log file is on the full disk too), the log file itself
(iteration 1, phase 5: only the rank's log folder, a second tmpfs, is full), the trainer writing
the weights (iteration 1, phase 10), publication (iteration 1, phase 11), a rollout's chunk
(iteration 2, phase 5) and the optimizer state written after the weights (iteration 2, phase 10).
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from coordination import exits
from coordination.checkpoints import is_complete, optimizer_pending
from coordination.layout import RunLayout
from coordination.records import read_record
from tests.e2e import check_complete_run, node_cmd
from tests.procs import env, wait_for_text
from tests.tmpfs import fill, mounted, need_root

pytestmark = pytest.mark.slow

HOLD = 5  # seconds a node waits at the start of the chosen phase while the test fills the disk
STOP = re.compile(r"ERROR baton: stopped: no space left on device \(ENOSPC, errno 28\) writing (under )?(?P<path>\S+): "
                  r"free space on the filesystem that holds (?P<df>\S+) \(`df -h (?P=df)`.*then restart this node "
                  r"with the same command to resume")


def _stop_at(procs, name: str, cmd: list[str], phase: int, disk: Path, leave: int = 0,
             pad: Path | None = None) -> Path:
    """Start the node holding at `phase`, fill `disk` up to `leave` free bytes meanwhile, and
    return the filler once the node has exited 8 with its one line. `pad`: a file the node appends
    to, ending inside a page it already holds; padded to the page's end, its next line needs a page
    the full filesystem does not have."""
    procs.start(name, cmd, env=env(BATON_HOLD_PHASE=f"{phase}:{HOLD}"))
    wait_for_text(procs, name, f"holding phase {phase} ", 300)
    filler = fill(disk, leave)
    if pad is not None:
        with open(pad, "ab") as fh:
            fh.write(b"\n" * (-pad.stat().st_size % 4096))
    code = procs.wait(name, 300)
    console = procs.log(name)
    assert code == exits.RESOURCE, console[-3000:]
    assert "Traceback" not in console and "Logging error" not in console, console[-3000:]
    stops = [line for line in console.splitlines() if "stopped:" in line]
    assert len(stops) == 1 and STOP.search(stops[0]), console[-3000:]
    assert console.rstrip().splitlines()[-1] == stops[0], "the stop is not the console's last line"
    return filler


def _path(procs, name: str) -> str:
    line = next(line for line in procs.log(name).splitlines() if "stopped:" in line)
    return STOP.search(line)["path"]


def _says(procs, name: str, path: Path) -> None:
    assert _path(procs, name) == str(path), procs.log(name)[-3000:]


def test_a_full_disk_at_each_write_stops_the_node_with_one_line_and_a_restart_loses_nothing(procs, tmp_path, assets):
    need_root()
    data, model = assets
    weights = (model / "model.safetensors").stat().st_size
    with contextlib.ExitStack() as stack:
        disk = stack.enter_context(mounted(tmp_path / "disk", "64m"))
        stack.callback(procs.cleanup)  # before the unmounts: no process may hold a file there
        log = disk / "run"
        log.mkdir(mode=0o750)
        lay = RunLayout(log)
        cmd = node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "1",
                       overrides=("run.max_iterations=2",))
        driver_log = lay.job("both").log_file(0, "driver")

        # Aggregation: the master's all.parquet, with the log on the same full disk.
        _stop_at(procs, "aggregate", cmd, 3, disk).unlink()
        _says(procs, "aggregate", lay.rollout_all("train", 1))

        # The log file itself: from here on the rank's log folder is a filesystem of its own, so
        # only the log is full; the node stops at its next check, naming the log.
        logs = stack.enter_context(mounted(driver_log.parent, "4m"))
        stack.callback(procs.cleanup)
        _stop_at(procs, "log", cmd, 5, logs, pad=driver_log).unlink()
        _says(procs, "log", driver_log)
        assert lay.rollout_done("eval", 1, 0).exists(), "the eval rollout did not finish before the stop"

        # The trainer writing the weights: its error (safetensors) names no file, the line names
        # the attempt's staging folder. The log has room again: the traceback goes there.
        _stop_at(procs, "weights", cmd, 10, disk, leave=weights // 2).unlink()
        assert _path(procs, "weights").startswith(str(lay.checkpoint_staging_dir)), _path(procs, "weights")
        assert "Traceback (most recent call last)" in driver_log.read_text()

        # Publication: the weights are in place, LATEST cannot be moved.
        _stop_at(procs, "publish", cmd, 11, disk).unlink()
        _says(procs, "publish", lay.latest)
        assert is_complete(lay.checkpoint(1)), "the weights were not renamed into place before LATEST"

        # A rollout chunk (iteration 2's eval: the trainer launched early has nothing left to write).
        _stop_at(procs, "chunk", cmd, 5, disk).unlink()
        assert _path(procs, "chunk").startswith(str(lay.rollout_rank_dir("eval", 2, 0))), _path(procs, "chunk")

        # The optimizer state: room for the weights, not for the state written after them.
        _stop_at(procs, "optimizer", cmd, 10, disk, leave=weights + weights // 2).unlink()

        procs.start("resume", cmd)
        assert procs.wait("resume", 400) == 0, procs.log("resume")[-3000:]
        check_complete_run(lay, 2, 24, 4, model)
        assert read_record(lay.latest).data["iteration"] == 2
        for it in (1, 2):
            assert is_complete(lay.checkpoint(it) / "optimizer"), f"iteration {it}'s optimizer state is missing"
            assert not optimizer_pending(lay.checkpoint(it))
        for it in (1, 2, 3):
            assert read_record(lay.metrics(it)).data["eval_accuracy"] is not None
