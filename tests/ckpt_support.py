"""Checkpoint files for tests of the checkpoint protocol that need no model: real safetensors files
carrying the run and iteration in their metadata, as the trainer writes them."""
from __future__ import annotations

from pathlib import Path

from coordination.checkpoint_files import Stamp


def stamped_file(path: Path, run_id: str, iteration: int, values: int) -> Path:
    """A safetensors file of `values` float32 numbers stamped with (run_id, iteration); its size
    grows with `values`, so tests can make files of equal or different sizes."""
    import numpy as np
    from safetensors.numpy import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.full(values, float(iteration), dtype=np.float32)}, str(path),
              metadata={"format": "pt", **Stamp(run_id, iteration).metadata()})
    return Path(path)
