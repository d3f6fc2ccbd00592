"""Every command in README.md is run: here (with the /shared/... paths mapped to temp folders),
by tests/test_demo.py (scripts/demo.sh), or by CI (.ci/run runs scripts/test.sh --all)."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.e2e import make_assets
from tests.procs import ROOT, env

README = (ROOT / "README.md").read_text()


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_gives_exactly_the_two_setup_commands_first_and_ci_runs_the_tests():
    cmds = readme_commands()
    assert cmds[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/test.sh --all" in ci
    # the demo is run by tests/test_demo.py (slow tier, part of --all)
    assert "scripts/demo.sh" in (ROOT / "tests" / "test_demo.py").read_text()


@pytest.mark.slow
def test_every_run_and_operator_command_of_the_readme_works(procs, tmp_path):
    data, model = make_assets(tmp_path / "assets")
    shared = tmp_path / "shared"
    (shared / "runs").mkdir(parents=True, mode=0o750)
    mapping = {"/shared/tasks": str(data), "/shared/models/start": str(model), "/shared/runs/r1": str(shared / "runs/r1")}

    def real(cmd: str) -> list[str]:
        for k, v in mapping.items():
            cmd = cmd.replace(k, v)
        return shlex.split(cmd)

    cmds = readme_commands()[2:]
    nodes = [c for c in cmds if c.startswith("scripts/run.sh") and "--dry-run" not in c]
    assert len(nodes) == 2 and "--master" in nodes[0] and "--worker 1" in nodes[1]
    for i, c in enumerate(nodes):
        procs.start(f"node{i}", real(c))
    codes = procs.wait_all(900)
    assert codes == {"node0": 0, "node1": 0}, procs.log("node1")[-3000:] + procs.log("node0")[-3000:]
    ran, out = set(nodes), {}
    for c in cmds:
        if c in ran:
            continue
        res = subprocess.run(real(c), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, (c, res.stdout[-2000:], res.stderr[-2000:])
        ran.add(c)
        out[c.split()[0]] = res.stdout
    assert ran == set(cmds)
    assert (shared / "runs/r1/report/timeline.png").exists()
    # The run finished before stop.sh ran: it says so and requests nothing.
    assert "already finished" in out["scripts/stop.sh"] and not (shared / "runs/r1/STOP").exists()
