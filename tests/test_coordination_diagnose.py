"""Failure messages say the cause: the lines of a failing rank's log that matter, and advice
picked by a table of (pattern -> advice), one test per row."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coordination import diagnose
from coordination.barrier import Arrival
from coordination.config import CoordinationConfig
from coordination.layout import RunLayout
from coordination.node import Node
from coordination.phases import BY_NUMBER
from coordination.runner import Step, failure_summary

TORCHRUN_TAIL = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/train/trainer.py", line 88, in main
[rank1]:     dist.init_process_group(backend)
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:446] Connection refused
[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/train/trainer.py", line 88, in main
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:446] Connection refused
E1123 10:00:00 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 42) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""


def test_relevant_lines_keep_the_exception_once_and_drop_traceback_frames():
    lines = diagnose.relevant_lines(TORCHRUN_TAIL)
    assert lines == [
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:446] Connection refused",
        "E1123 10:00:00 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 42) of binary: python",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"]


@pytest.mark.parametrize("text", [
    "RuntimeError: [gloo/transport/tcp/pair.cc:446] Connection refused",
    "Warning: Unable to resolve hostname to a (local) address. Using the loopback address as fallback. "
    "Manually set the network interface to bind to with GLOO_SOCKET_IFNAME.",
    "RuntimeError: [enforce fail at gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find address for: ib9",
    "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
    "torch.distributed.DistNetworkError: The client socket has timed out after 60s while trying to connect to "
    "(10.0.0.1, 29500).",
    "NCCL WARN Bootstrap : no socket interface found",
    "gloo bound to 127.0.0.1",
])
def test_network_failures_advise_the_socket_interface_not_more_attempts(text):
    todo = diagnose.advice(text)
    assert todo is not None and "coordination.socket_ifname" in todo and "coordination.master_addr" in todo
    assert "max_attempts" not in todo


@pytest.mark.parametrize("text", [
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:22423: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:5001",
])
def test_a_peer_gone_mid_training_is_told_apart_from_a_network_misconfiguration(text):
    todo = diagnose.advice(text)
    assert todo is not None and "another node ended" in todo and "train.max_attempts" in todo
    assert "socket_ifname" not in todo


def test_full_disk_advice_names_the_path_from_the_error():
    todo = diagnose.advice("OSError: [Errno 28] No space left on device: '/shared/run/checkpoints/.iter-3'",
                           "/shared/run")
    assert todo is not None and "disk" in todo and "/shared/run/checkpoints/.iter-3" in todo


def test_full_disk_without_a_path_names_the_log_path():
    todo = diagnose.advice("safetensors_rust.SafetensorError: No space left on device (os error 28)", "/shared/run")
    assert todo is not None and "/shared/run" in todo


def test_unknown_failure_gets_no_advice():
    assert diagnose.advice("RuntimeError: the loss is NaN at step 3") is None


def test_every_row_of_the_table_has_a_test_above():
    assert [c.name for c in diagnose.CAUSES] == ["disk full", "peer lost", "network"]


def _step(tmp_path: Path) -> Step:
    lay = RunLayout(tmp_path)
    node = Node(lay, lay.job("both"), "r", 0, 2, CoordinationConfig(), generation=1)
    return Step(node, 3, BY_NUMBER[10], 2, {})


def test_failure_summary_shows_each_ranks_relevant_log_lines_and_the_advice(tmp_path: Path):
    err = ("ChildFailed: torchrun (iteration 3, attempt 2) exited with code 1; from /r/logs/rank-1/trainer.log:\n"
           + TORCHRUN_TAIL)
    text = failure_summary(_step(tmp_path), {1: Arrival(1, 1, False, err, {}),
                                             0: Arrival(0, 1, False, "ChildFailed: attempt 2 already failed", {})})
    first, *rest = text.splitlines()
    logs = RunLayout(tmp_path).job("both")
    assert first == (f"iteration 3 failed at phase 10 train: rank 0: ChildFailed: attempt 2 already failed "
                     f"(details: {logs.log_file(0, 'driver')}); rank 1: ChildFailed: torchrun (iteration 3, "
                     f"attempt 2) exited with code 1; from /r/logs/rank-1/trainer.log: (details: "
                     f"{logs.log_file(1, 'driver')})")
    assert "    [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:446] Connection refused" in rest
    assert rest[-1].startswith("  what to do: a network problem") and "coordination.socket_ifname" in rest[-1]


@pytest.mark.slow
def test_real_torchrun_attempt_failing_on_a_bad_interface_names_gloos_words_and_the_setting(tmp_path: Path):
    from coordination.children import ChildFailed, run_watched
    from train.launch import torchrun_command, torchrun_env
    from tests.procs import env

    step = _step(tmp_path)
    log_file = tmp_path / "trainer.log"
    cmd = torchrun_command(python=sys.executable, nnodes=1, node_rank=0, nproc_per_node=1,
                           rdzv_endpoint="127.0.0.1:0", rdzv_id="t", is_host=True, local_addr=None,
                           module="tests.failing_gloo", args=[])
    with pytest.raises(ChildFailed) as info:
        run_watched(cmd, env=torchrun_env(env(), omp_threads=1, socket_ifname="baton-none0"), log_file=log_file,
                    node=step.node, peers=[], what="torchrun (iteration 3, attempt 2)", check_every=0.5)
    text = failure_summary(step, {0: Arrival(0, 1, False, f"ChildFailed: {info.value}", {})})
    assert "Unable to find address for: baton-none0" in text
    assert "what to do: a network problem" in text and "max_attempts" not in text
