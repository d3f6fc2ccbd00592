"""scripts/demo.sh as a user runs it (slow tier: about 10 minutes on 2 cores). It must finish,
print the per-iteration table and beat the SFT start by at least 10 points of eval accuracy."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.procs import ROOT, env


@pytest.mark.slow
def test_demo_runs_two_nodes_and_rl_beats_the_sft_start(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], cwd=ROOT, env=env(BATON_DEMO_DIR=str(tmp_path)),
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    out = res.stdout
    m = re.search(r"eval accuracy ([0-9.]+) \(checkpoint 0\) -> ([0-9.]+) \(checkpoint (\d+)\): ([+-][0-9.]+) points",
                  out)
    assert m, out[-3000:]
    start, end = float(m.group(1)), float(m.group(2))
    assert end - start >= 0.10, f"RL gained only {100 * (end - start):.1f} points ({start:.3f} -> {end:.3f})"
    assert (tmp_path / "run" / "report" / "learning.png").exists()
    # one line per finished iteration while it runs, before the final table
    done = [m.start() for m in re.finditer(r"iteration \d+ done in [0-9.]+ s: train reward", out)]
    assert len(done) >= int(m.group(3)) and done[-1] < out.index("per iteration"), out[-3000:]
    assert "logs:" in out and "metrics:" in out
