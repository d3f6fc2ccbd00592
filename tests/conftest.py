from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import Procs


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path / "proc-logs")
    try:
        yield p
    finally:
        p.cleanup()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o750)
    os.chmod(d, 0o750)
    return d
