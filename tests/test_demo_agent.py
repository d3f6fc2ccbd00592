"""BATON_DEMO=agent scripts/demo.sh as a user runs it, on seed 0 (slow tier: the demo's wall time,
about 4 minutes on 2 quiet cores, 10 min 33 s at a load average of 6-8). It must finish,
raise the greedy episode success rate of the calculator by at least 20 points over the SFT start
(README's claim), roll out multi-turn episodes on both nodes and train on them.

As for the first demo, the demo and the nodes run in their own sessions; whatever happens, the
test stops both nodes' process groups, and a failure shows the tails of the logs."""
from __future__ import annotations

import pytest

from coordination.layout import RunLayout
from coordination.records import read_record
from tests.test_demo import run_demo


@pytest.mark.slow
def test_agent_demo_runs_two_nodes_and_rl_raises_the_success_rate_by_20_points(procs, tmp_path):
    work = tmp_path / "demo"
    _, m = run_demo(procs, work, BATON_DEMO="agent", BATON_DEMO_SEED="0")
    start, end = float(m.group(1)), float(m.group(2))
    assert end - start >= 0.20, f"RL raised the success rate by only {100 * (end - start):.1f} points " \
                                f"({start:.3f} -> {end:.3f})"
    lay = RunLayout(work / "run")
    for rank in (0, 1):
        done = read_record(lay.rollout_done("train", 1, rank)).data
        assert done["samples"] > 0, f"node {rank} rolled out nothing in iteration 1: {done}"
    episodes = read_record(lay.rollout_stats("train", 1)).data["episodes"]
    assert episodes["turns_mean"] > 1.0, episodes  # the tool call, then the answer
    assert read_record(lay.latest).data["iteration"] == int(m.group(3))
