from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import Procs


# What the pinned wheels need of the machine (README, GPU clusters): said whenever CUDA is unusable.
CUDA_NEEDS = ("torch 2.13.0 from PyPI is the CUDA 13 build and vLLM 0.32 brings CUDA 13 kernels: they need an "
              "NVIDIA driver >= 580 (`nvidia-smi` shows the driver version)")


def gpu_expected() -> str | None:
    """Why this machine should have a usable GPU (so an unusable CUDA is a failure, not a skip)."""
    if os.environ.get("BATON_REQUIRE_GPU") == "1":
        return "BATON_REQUIRE_GPU=1"
    if Path("/dev/nvidiactl").exists():
        return "/dev/nvidiactl exists (an NVIDIA driver is loaded)"
    return None


def pytest_collection_modifyitems(config, items):
    """The gpu tier (tests marked gpu) needs CUDA. On a machine without a GPU those tests are
    skipped, saying so; on one that should have a usable GPU (`gpu_expected`) they fail, naming the
    driver requirement: a tier that skips everything there would pass without having run."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    why = gpu_expected()
    if why is not None:  # pytest_runtest_setup fails each of them
        config.stash[_UNUSABLE] = (f"CUDA is unusable (torch.cuda.is_available() is False, torch built for CUDA "
                                   f"{torch.version.cuda}) although {why}: {CUDA_NEEDS}")
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/test.sh --gpu on a GPU node)")
    for item in gpu_items:
        item.add_marker(skip)


_UNUSABLE = pytest.StashKey[str]()


def pytest_runtest_setup(item):
    unusable = item.config.stash.get(_UNUSABLE, None)
    if unusable is not None and item.get_closest_marker("gpu"):
        pytest.fail(unusable, pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def cpu_tier_on_the_cpu(request):
    """Every module but the gpu tier's runs on the CPU, on a GPU node too: its expectations (gloo,
    float32 tolerances, two trainer processes per node) are the CPU's, and `auto` devices would
    otherwise pick the GPU. An empty CUDA_VISIBLE_DEVICES hides it from this process's torch
    (before anything here initialises CUDA) and from every child, which inherit os.environ
    (tests/procs.py env), and baton's own GPU checks read it (train/memory_plan.py gpu_visible).
    Module scope, autouse: set before the module's own fixtures start anything. So gpu tests live
    in modules marked gpu as a whole (pytestmark). A session that also ran gpu tests (--all on a
    GPU node) may already hold a CUDA context in this process; children still see no GPU."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """The CI machine has 2 shared cores; torch's OpenMP pool spins badly when oversubscribed.
    Modules that run models in the test process use it: pytestmark = usefixtures(...)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """The transformers engine serving a fresh tiny model, for one module's tests."""
    from rollout.engines.transformers_engine import TransformersEngine
    from train.tiny import write_tiny_model

    eng = TransformersEngine()
    eng.start(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))
    yield eng
    eng.stop()


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


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group in the test process (train.distributed), for the module's tests
    that build, train and save models in-process."""
    from train.distributed import init_distributed, shutdown

    info = init_distributed(120.0)
    yield info
    shutdown()
