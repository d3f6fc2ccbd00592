"""`python -m bench --what WHAT`: one command for every benchmark, refusing what it does not know."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.__main__ import WHAT

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_help_lists_every_benchmark():
    res = bench("--help")
    assert res.returncode == 0, res.stderr
    assert [line.split()[0] for line in res.stdout.splitlines()[2:]] == list(WHAT)


def test_an_unknown_benchmark_is_refused_by_name_with_the_choices():
    res = bench("--what", "nope")
    assert res.returncode == 2
    assert "--what 'nope' is none of coordination, rollout" in res.stderr


def test_options_without_what_are_refused():
    res = bench("--json")
    assert res.returncode == 2
    assert "the first option must be --what WHAT (got --json)" in res.stderr


def test_what_hands_the_rest_to_the_chosen_benchmark():
    res = bench("--what=coordination", "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Usage: python -m bench --what coordination [OPTIONS]")
    assert "--straggler-seconds" in res.stdout
