"""scripts/slurm.sbatch, run as SLURM would run it: one task per node with its SLURM_NODEID.

There is no SLURM here, so `srun` is a stand-in on PATH that starts the task once per node of
the allocation, in turn, with the variables srun sets; the template and run.sh are the real ones
and run with --dry-run."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.e2e import make_assets
from tests.procs import ROOT, env

FAKE_SRUN = """#!/usr/bin/env bash
# stand-in for srun: skip srun's own options, run the task once per node of the allocation as
# SLURM_NODEID 0..N-1
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i "$@" > "$SRUN_OUT/node-$i.out" 2>&1 || echo "node $i exit $?" >> "$SRUN_OUT/failed"
done
"""


def _sbatch(tmp_path: Path, nodes: int, *args: str) -> dict[int, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o750)
    out = tmp_path / f"out-{nodes}"
    out.mkdir()
    e = dict(env(), PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NUM_NODES=str(nodes),
             SLURM_SUBMIT_DIR=str(ROOT), SRUN_OUT=str(out))
    res = subprocess.run(["bash", str(ROOT / "scripts/slurm.sbatch"), *args], cwd=tmp_path, env=e,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert not (out / "failed").exists(), [(out / f.name).read_text() for f in out.iterdir()]
    return {i: (out / f"node-{i}.out").read_text() for i in range(nodes)}


def test_sbatch_template_starts_the_master_on_the_first_node_and_workers_by_node_index(tmp_path):
    data, model = make_assets(tmp_path / "assets")
    log = tmp_path / "run"
    outs = _sbatch(tmp_path, 3, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both",
                   "--eval-interval", "0", "--dry-run", f"model.path={model}", "tasks.tasks_per_iteration=30")
    assert "job both, master of 3 node(s)" in outs[0]
    assert "job both, worker 1 of 3 node(s)" in outs[1] and "job both, worker 2 of 3 node(s)" in outs[2]
    # equal weights by default: 30 tasks split 10/10/10
    assert "train rank 0: 10 tasks <- this node" in outs[0] and "train rank 2: 10 tasks <- this node" in outs[2]
    assert not log.exists()


def test_sbatch_template_keeps_the_users_rank_weights(tmp_path):
    data, model = make_assets(tmp_path / "assets")
    outs = _sbatch(tmp_path, 2, "--data-path", str(data), "--log-path", str(tmp_path / "run"), "--rl-phase", "both",
                   "--eval-interval", "0", "--rank-weights", "2,1", "--dry-run", f"model.path={model}",
                   "tasks.tasks_per_iteration=30")
    assert "train rank 0: 20 tasks <- this node" in outs[0] and "train rank 1: 10 tasks <- this node" in outs[1]
