"""Start real node processes for tests and always clean them up (by process group)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def env(**extra: str) -> dict:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(extra)
    return e


class Procs:
    """A set of child processes, each in its own process group, killed at teardown."""

    def __init__(self, logs: Path):
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.groups: list[int] = []  # process groups a child started on its own (setsid), also killed

    def start(self, name: str, cmd: list[str], **kw) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        p = subprocess.Popen(cmd, cwd=ROOT, env=kw.pop("env", env()), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, **kw)
        log.close()
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout=timeout)

    def wait_all(self, timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        out = {}
        for name, p in self.procs.items():
            try:
                out[name] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} still running after {timeout} s; log:\n{self.log(name)[-3000:]}")
        return out

    def signal(self, name: str, sig: int) -> None:
        os.killpg(self.procs[name].pid, sig)

    def adopt(self, pgids: list[int]) -> None:
        """Process groups a child started in sessions of their own: cleanup kills them too."""
        self.groups.extend(g for g in pgids if g not in self.groups)

    def alive_groups(self) -> list[int]:
        """The adopted groups that still have a process."""
        alive = []
        for g in self.groups:
            try:
                os.killpg(g, 0)
            except ProcessLookupError:
                continue
            alive.append(g)
        return alive

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for g in [p.pid for p in self.procs.values()] + self.groups:  # nothing of any group may survive
            try:
                os.killpg(g, signal.SIGCONT)
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                continue


def wait_for_text(procs: Procs, name: str, text: str, timeout: float) -> float:
    """Poll a child's log until `text` appears; returns the monotonic time it was seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in procs.log(name):
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"{text!r} did not appear in {name}'s log within {timeout} s:\n{procs.log(name)[-3000:]}")


def bench_node(log_path: Path, rank: int, nodes: int, iterations: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bench.protocol", "--log-path", str(log_path), "--node-rank", str(rank),
            "--nodes", str(nodes), "--iterations", str(iterations), *extra]
