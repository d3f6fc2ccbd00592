"""Launching a child cannot hang the node: no Python code between fork and exec, a bounded launch,
the parent-death signal armed, output that a fenced node no longer writes, and a main thread that
stays in one place named in the heartbeat. Real processes and files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordination.heartbeat import HeartbeatWriter
from coordination.procgroup import ChildStartError, start_child
from coordination.records import FenceGuard, install_fence, read_record
from coordination.stall import MainThreadWatch, tick
from tests.procs import ROOT, env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_two_hundred_launches_never_wait_on_an_import_lock_held_at_fork(tmp_path: Path):
    # The contender holds ctypes' module lock in one thread and imports fresh modules in two more
    # while it launches; a launch that ran Python in the forked child (preexec_fn importing
    # ctypes) hangs on its first child. Bounded: a hang is a failure, not a stuck test.
    modules = tmp_path / "modules"
    modules.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "launch_contender.py"), str(tmp_path / "log"),
                             "200", str(modules)], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("launching children hung while another thread held an import lock")
    assert proc.returncode == 0, err.decode()
    assert json.loads(out.decode().splitlines()[-1])["launched"] == 200


def test_a_child_that_does_not_exec_within_the_bound_fails_naming_its_command_and_leaves_nothing(tmp_path: Path):
    # 1 ms is less than any interpreter needs to start the exec shim: the bound is always passed.
    with pytest.raises(ChildStartError) as err:
        start_child(["sleep", "30"], env=dict(os.environ), log_file=tmp_path / "child.log", what="probe trainer",
                    start_timeout=0.001)
    text = str(err.value)
    assert "probe trainer did not start within coordination.child_start_timeout = 0.001 s" in text
    assert "command: sleep 30" in text
    time.sleep(0.2)
    leftovers = subprocess.run(["pgrep", "-f", "exec_shim.py .* -- sleep 30$"], capture_output=True, text=True)
    assert leftovers.stdout == "", f"the stopped launch left processes: {leftovers.stdout}"


def test_a_command_that_cannot_be_executed_fails_at_launch_with_the_reason(tmp_path: Path):
    with pytest.raises(ChildStartError) as err:
        start_child(["/nonexistent/torchrun", "--help"], env=dict(os.environ), log_file=tmp_path / "child.log",
                    what="torchrun")
    assert "torchrun could not start: cannot execute /nonexistent/torchrun: No such file or directory" in str(err.value)


def test_output_reaches_the_log_after_a_header_and_the_exit_code_is_the_commands(tmp_path: Path):
    log_file = tmp_path / "child.log"
    log_file.write_bytes(b"earlier launch\n")
    child = start_child(["sh", "-c", "echo out; echo err >&2; exit 3"], env=dict(os.environ), log_file=log_file,
                        what="probe")
    assert child.wait(30) == 3
    child.join_output()
    text = log_file.read_text()
    assert text.startswith("earlier launch\n\n==== ") and "probe: sh -c echo out; echo err >&2; exit 3\n" in text
    assert log_file.read_bytes()[child.log_start:] == b"out\nerr\n"


def test_the_child_gets_sigterm_when_the_node_that_started_it_is_killed(tmp_path: Path):
    # A stand-in node starts `sleep 300` through the launch path and is killed by SIGKILL; the
    # kernel's parent-death signal, armed by the shim and kept across its exec, ends the child.
    code = ("import os, sys\nfrom pathlib import Path\nfrom coordination.procgroup import start_child\n"
            "c = start_child(['sleep', '300'], env=dict(os.environ), log_file=Path(sys.argv[1]), what='sleeper')\n"
            "print(c.pid, flush=True)\nimport time\ntime.sleep(300)\n")
    node = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "child.log")], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, start_new_session=True)
    child_pid = None
    try:
        child_pid = int(node.stdout.readline())
        assert _pid_alive(child_pid)
        node.kill()
        node.wait(10)
        deadline = time.monotonic() + 10
        while _pid_alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(child_pid), "the child outlived the node that started it"
    finally:
        node.kill()
        node.wait(10)
        if child_pid is not None and _pid_alive(child_pid):
            os.killpg(child_pid, signal.SIGKILL)


def test_a_fenced_node_adds_nothing_of_its_childs_output_to_the_log(tmp_path: Path):
    newer = tmp_path / "claim-2"
    install_fence(FenceGuard(newer))
    log_file = tmp_path / "trainer.log"
    child = start_child(["sh", "-c", "i=0; while [ $i -lt 400 ]; do echo line $i; i=$((i+1)); sleep 0.01; done"],
                        env=dict(os.environ), log_file=log_file, what="talker")
    try:
        deadline = time.monotonic() + 20
        while b"line 5\n" not in log_file.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.02)
        newer.write_bytes(b"taken over")
        time.sleep(1.2)  # the copier probes the fence at most once a second
        frozen = log_file.read_bytes()
        assert child.wait(30) == 0  # the child was never blocked: its output was read and dropped
        child.join_output()
        assert log_file.read_bytes() == frozen
        assert b"line 399" not in frozen
    finally:
        child.stop(5)


def test_a_main_thread_inside_one_call_is_named_in_the_heartbeat_and_a_polling_one_is_not(tmp_path: Path):
    hb = tmp_path / "hb.json"
    watch = MainThreadWatch(0.5, time.monotonic)
    writer = HeartbeatWriter(hb, run_id="r", generation=1, job="both", rank=1, interval=0.1, watch=watch.check)
    writer.update(message="waiting at barrier 2")
    writer.start()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # polling, as every bounded wait does
            tick()
            time.sleep(0.05)
        assert "stuck" not in read_record(hb).data
        time.sleep(2.0)  # one call that does not return: no poll, the stack stays the same
        data = read_record(hb).data
    finally:
        writer.stop()
    assert data["message"].startswith("waiting at barrier 2 [main thread in one place for ")
    assert "test_child_launch.py:" in data["stuck"] and "test_a_main_thread_inside_one_call" in data["stuck"]


def test_the_stall_warning_reaches_the_log_once_per_bound(caplog):
    watch = MainThreadWatch(0.3, time.monotonic)
    reports: list[str | None] = []

    def look() -> None:
        for _ in range(12):
            reports.append(watch.check())
            time.sleep(0.1)

    with caplog.at_level("WARNING", logger="baton.stall"):
        looker = threading.Thread(target=look)
        looker.start()
        looker.join()  # the main thread waits in join: one place for 1.2 s
    warnings = [r for r in caplog.records if "main thread in one place" in r.getMessage()]
    assert 1 <= len(warnings) <= 4 and any(reports)
