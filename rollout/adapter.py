"""A LoRA adapter folder as the engines serve it.

The format is peft's (`adapter_config.json` + `adapter_model.safetensors`): what the trainer
publishes in a checkpoint's `adapter/` with `train.lora.publish=adapters`, what vLLM's
`/v1/load_lora_adapter` reads and what the transformers engine merges with peft. Both engines
check a folder here before touching their model, so a wrong path fails with the same message
whichever engine serves it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rollout.engine import EngineError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class Adapter:
    """A checked adapter folder: its resolved path and its largest LoRA rank."""

    path: Path
    rank: int


def read_adapter(folder: Path) -> Adapter:
    """Check that `folder` is a peft LoRA adapter and read its rank (the largest, when a
    `rank_pattern` gives some layers another one)."""
    folder = Path(folder).resolve()
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    if missing:
        raise EngineError(f"{folder} is not a LoRA adapter folder (no {' or '.join(missing)}); give the adapter/ "
                          f"folder of a checkpoint published with train.lora.publish=adapters")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read {folder / CONFIG_FILE}: {exc}; the adapter folder is damaged") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise EngineError(f"{folder / CONFIG_FILE} describes a {kind} adapter; the engines serve LoRA adapters only")
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    try:
        rank = max(int(r) for r in ranks if r is not None)
    except (TypeError, ValueError):
        raise EngineError(f"{folder / CONFIG_FILE} has no valid LoRA rank (r={config.get('r')!r}); "
                          f"the adapter folder is damaged") from None
    if rank < 1:
        raise EngineError(f"{folder / CONFIG_FILE} gives LoRA rank {rank}; a LoRA adapter has rank >= 1")
    return Adapter(folder, rank)
