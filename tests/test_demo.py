"""scripts/demo.sh as a user runs it (slow tier: 8-10 minutes on 2 quiet cores). It must finish,
print the per-iteration table and beat the SFT start by at least 10 points of eval accuracy.

The demo runs in its own session and the nodes in theirs (setsid); whatever happens, the test
stops both nodes' process groups, and a demo that overruns fails with the tails of its own output
and of each node's log and trainer log, so the failure says where it stood."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.procs import ROOT, Procs, env

TIMEOUT = 1800


def _tail(path: Path, chars: int = 2500) -> str:
    try:
        return f"---- {path} (last {chars} chars)\n{path.read_text(errors='replace')[-chars:]}\n"
    except OSError as exc:
        return f"---- {path}: {exc}\n"


def _stop(procs: Procs, work: Path) -> None:
    """TERM the demo (its trap TERMs the nodes) and the nodes' groups, so the drivers stop their
    trainers and engines, and wait up to 30 s; the fixture's cleanup SIGKILLs whatever is left."""
    pgid_file = work / "nodes.pgid"
    procs.adopt([int(x) for x in pgid_file.read_text().split()] if pgid_file.exists() else [])
    demo = procs.procs["demo"]
    if demo.poll() is None:
        procs.signal("demo", signal.SIGTERM)
    for g in procs.alive_groups():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(g, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (demo.poll() is None or procs.alive_groups()):
        time.sleep(0.2)


def run_demo(procs: Procs, work: Path, **variables: str) -> tuple[str, re.Match]:
    """Run scripts/demo.sh with BATON_DEMO_DIR=`work` and `variables`, stop whatever it started,
    assert that it finished with exit 0 and printed its eval line; (its output, that line's match:
    start, end, checkpoint). A failure shows the tails of the demo's, the nodes' and the trainers'
    logs (and SFT's, when there is one)."""
    demo = procs.start("demo", ["bash", str(ROOT / "scripts" / "demo.sh")],
                       env=env(BATON_DEMO_DIR=str(work), **variables), stdin=subprocess.DEVNULL)
    try:
        rc = demo.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _stop(procs, work)
    out = procs.log("demo")
    sft = [work / "sft.log"] if (work / "sft.log").exists() else []
    logs = "".join(_tail(p) for p in [procs.logs / "demo.log", *sft, work / "node-0.log", work / "node-1.log",
                                      *sorted((work / "run" / "logs").glob("*/rank-*/trainer.log"))])
    assert rc is not None, f"the demo did not finish within {TIMEOUT} s; where it stood:\n{logs}"
    assert rc == 0, logs
    m = re.search(r"eval accuracy ([0-9.]+) \(checkpoint 0\) -> ([0-9.]+) \(checkpoint (\d+)\): ([+-][0-9.]+) points",
                  out)
    assert m, out[-3000:]
    return out, m


@pytest.mark.slow
def test_demo_runs_two_nodes_and_rl_beats_the_sft_start(procs, tmp_path):
    work = tmp_path / "demo"  # the demo removes and recreates its folder: procs' logs stay beside it
    out, m = run_demo(procs, work)
    start, end = float(m.group(1)), float(m.group(2))
    assert end - start >= 0.10, f"RL gained only {100 * (end - start):.1f} points ({start:.3f} -> {end:.3f})"
    assert (work / "run" / "report" / "learning.png").exists()
    # one line per finished iteration while it runs, before the final table
    done = [m.start() for m in re.finditer(r"iteration \d+ done in [0-9.]+ s: train reward", out)]
    assert len(done) >= int(m.group(3)) and done[-1] < out.index("per iteration"), out[-3000:]
    assert "logs:" in out and "metrics:" in out
