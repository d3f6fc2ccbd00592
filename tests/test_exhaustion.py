"""Resource exhaustion is a stop with one line and exit 8 (coordination/exhaustion.py): which errors
count, what the line says, and the parts that make it one line (the log file's fallback, the
heartbeat's warning, the runner not reporting it for a retry). Full disks are real: /dev/full and
small tmpfs mounts (root); a log file failing with EIO is the one faked filesystem corner."""
from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from coordination import exhaustion, exits, log as blog
from coordination.children import ChildFailed
from coordination.config import ConfigError, CoordinationConfig
from coordination.exhaustion import ResourceExhausted
from coordination.manifest import UnusableLogPath
from coordination.runner import PhaseFailed
from tests.tmpfs import fill, mounted

ADVICE = {errno.ENOSPC: "df -h", errno.EDQUOT: "quota -s", errno.EROFS: "read-write",
          errno.EMFILE: "ulimit -n", errno.ENFILE: "fs.file-max"}


@pytest.mark.parametrize("err", sorted(ADVICE), ids=lambda e: errno.errorcode[e])
def test_each_shortage_is_exit_8_with_a_line_naming_errno_path_and_what_to_free(err, tmp_path):
    path = tmp_path / "chunk-00001.parquet"
    exc = OSError(err, "whatever the OS said", str(path))
    assert exits.classify(exc) == exits.RESOURCE
    line = exits.message(exc)
    assert f"({errno.errorcode[err]}, errno {err})" in line and str(path) in line, line
    assert ADVICE[err] in line and "restart this node with the same command" in line, line
    assert "\n" not in line


def test_a_shortage_behind_another_error_counts_and_the_folder_stands_in_for_a_missing_path(tmp_path):
    def wrapped() -> None:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")  # os.write names no file
        except OSError as exc:
            raise RuntimeError("writing the chunk failed") from exc

    with pytest.raises(RuntimeError) as info:
        wrapped()
    assert exits.classify(info.value) == exits.RESOURCE
    assert f"writing under {tmp_path}:" in exits.message(info.value, str(tmp_path))


@pytest.mark.parametrize("text, err, path", [
    ("trainer rank 0 failed: OSError: [Errno 28] No space left on device: '/run/checkpoints/x'", errno.ENOSPC,
     "/run/checkpoints/x"),
    ("SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)", errno.ENOSPC, None),
    ("OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device", errno.ENOSPC, None),
    ("CheckpointError: writing the optimizer state failed: [Errno 122] Disk quota exceeded: '/q/o'", errno.EDQUOT,
     "/q/o"),
    ("OSError: [Errno 30] Read-only file system: '/ro/f'", errno.EROFS, "/ro/f"),
    ("OSError: [Errno 23] Too many open files in system", errno.ENFILE, None),
    ("OSError: [Errno 24] Too many open files", errno.EMFILE, None),
])
def test_a_childs_words_for_a_shortage_stop_the_node(text, err, path, tmp_path):
    exc = ChildFailed(f"training (iteration 1, attempt 1): {text}")
    assert exits.classify(exc) == exits.RESOURCE
    found = exhaustion.of(exc, tmp_path)
    assert found.errno == err and found.path == path
    assert (path or f"under {tmp_path}") in str(found)


def test_other_errors_keep_their_codes():
    assert exits.classify(OSError(errno.EIO, "Input/output error", "/x")) == exits.ERROR
    # Only a child's report is read for words: the driver's own errors say what they are.
    assert exits.classify(RuntimeError("No space left on device")) == exits.ERROR
    assert exits.classify(PhaseFailed("rank 1: No space left on device")) == exits.ABORTED
    assert exits.classify(ConfigError("bad")) == exits.USAGE
    assert exits.classify(UnusableLogPath("--log-path /x is on a full filesystem")) == exits.USAGE
    assert exits.classify(ChildFailed("exited with code 1: Killed")) == exits.ERROR


def test_an_attempt_that_failed_elsewhere_or_before_is_reported_even_when_its_words_say_disk_full():
    """A restarted node must not stop again on another rank's (or its predecessor's) old report of
    a full disk: it reports the attempt failed, and the master retries."""
    from rl.driver import AttemptFailed

    words = "attempt 1 already failed on rank 0: SafetensorError: No space left on device (os error 28)"
    assert exits.classify(AttemptFailed(words)) == exits.ERROR


def test_a_log_file_on_a_full_device_is_dropped_without_logging_error_blocks_and_ends_the_node(capfd):
    logger = blog.setup("test rank0", Path("/dev/full"))  # every write to it fails with ENOSPC
    try:
        blog.check()  # nothing lost yet
        logging.getLogger("baton.test").info("first line")
        logging.getLogger("baton.test").info("second line")
        logging.getLogger("baton.test").error("only for the file", extra=blog.FILE_ONLY)
        err = capfd.readouterr().err
        assert "first line" in err and "second line" in err, err
        assert "Logging error" not in err and "Traceback" not in err and "only for the file" not in err, err
        with pytest.raises(ResourceExhausted) as info:
            blog.check()
        assert "(ENOSPC, errno 28) writing /dev/full" in str(info.value)
    finally:
        blog.setup("test")
    blog.check()  # a new setup forgets the lost file
    assert logger.handlers and all(not isinstance(h, logging.FileHandler) for h in logger.handlers)


def test_a_log_file_that_fails_otherwise_says_so_once_and_the_node_goes_on(capfd, tmp_path, monkeypatch):
    logger = blog.setup("test rank0", tmp_path / "driver.log")
    try:
        handler = next(h for h in logger.handlers if isinstance(h, logging.FileHandler))

        def broken(_text):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(handler.stream, "write", broken)
        for k in range(3):
            logging.getLogger("baton.test").info("line %d", k)
        err = capfd.readouterr().err
        assert err.count("cannot be written") == 1 and "Logging error" not in err, err
        assert all(f"line {k}" in err for k in range(3)), err
        blog.check()  # EIO is no shortage: the node goes on, logging to the console
    finally:
        blog.setup("test")


def test_writes_name_the_file_a_full_disk_refused(tmp_path):
    from coordination import timeline
    from coordination.records import publish_bytes

    with mounted(tmp_path / "disk", "1m") as disk:
        fill(disk)
        target = disk / "record.json"
        with pytest.raises(OSError) as info:
            publish_bytes(target, b"x" * 8192)
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
        assert not list(disk.glob(".record.json.tmp-*")), "the temp file was left behind"
        with pytest.raises(OSError) as info:
            timeline.append(disk / "timeline.jsonl", {"event": "x" * 8192})
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(disk / "timeline.jsonl")


def test_heartbeat_write_errors_are_said_once_not_every_beat(tmp_path, caplog):
    from coordination.heartbeat import HeartbeatWriter

    with mounted(tmp_path / "disk", "1m") as disk:
        hb = HeartbeatWriter(disk / "heartbeat.json", run_id="r", generation=1, job="both", rank=0, interval=1.0)
        hb.state["message"] = "x" * 8192  # more than the page the filler leaves
        fill(disk)
        with caplog.at_level(logging.INFO, logger="baton.heartbeat"):
            for _ in range(4):
                hb.beat()
            hb.beat(last=True)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage(), caplog.text
        (disk / "filler").unlink()
        with caplog.at_level(logging.INFO, logger="baton.heartbeat"):
            hb.beat()
        assert "written again" in caplog.text and (disk / "heartbeat.json").exists()


def test_a_full_disk_in_a_phase_stops_the_runner_instead_of_reporting_it_for_a_retry(run_dir):
    from coordination.barrier import Barrier
    from coordination.join import join_job
    from coordination.layout import RunLayout
    from coordination.phases import phases_of
    from coordination.runner import Phase, PhaseRunner

    node = join_job(RunLayout(run_dir), job="both", rank=0, num_nodes=1, job_facts={"rank_weights": [1]},
                    config={"test": "exhaustion"}, cfg=CoordinationConfig(heartbeat_interval=0.5))
    try:
        def action(step):
            if step.spec.number == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "rollouts" / "chunk"))
            return {}

        spec = next(s for s in phases_of("both") if s.number == 2)
        runner = PhaseRunner(node, [Phase(spec, action)], max_iterations=1)
        with pytest.raises(ResourceExhausted) as info:
            runner.run()
        assert str(run_dir / "rollouts" / "chunk") in str(info.value)
        assert Barrier(node, 1, 2, spec.name, 1).own_arrival() is None, "the stop was reported as a phase failure"
    finally:
        node.close("failed")
