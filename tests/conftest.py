from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import Procs


def pytest_collection_modifyitems(config, items):
    """The gpu tier (tests marked gpu) needs CUDA: without it those tests are skipped, saying so;
    scripts/test.sh --gpu refuses to start on a machine without a GPU instead."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/test.sh --gpu on a GPU node)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """The CI machine has 2 shared cores; torch's OpenMP pool spins badly when oversubscribed.
    Modules that run models in the test process use it: pytestmark = usefixtures(...)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def no_fence_left_behind():
    """Node.join installs a process-wide fence guard; a test that joins in-process and does not
    close its node must not leave it (or its environment variable) to the next test."""
    yield
    from coordination.records import install_fence

    install_fence(None)


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


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    from tests.e2e import make_assets

    return make_assets(tmp_path_factory.mktemp("e2e-assets"))
