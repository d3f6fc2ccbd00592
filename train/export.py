"""Writing a checkpoint folder from a running trainer (collective; used by RL and SFT).

Order: every rank writes its optimizer shard; the ranks agree that all shards are there; the
full state dict is gathered to rank 0, which writes the Hugging Face folder, `trainer_state.json`
and, last, the completeness marker; the ranks agree again. A failure anywhere leaves a folder
without a marker, which publication refuses.

With LoRA (train/lora.py) rank 0 writes the adapters to `adapter/` and, unless
`lora.publish=adapters`, the merged full weights as the Hugging Face folder; `trainer_state.json`
records the LoRA settings and the base model the adapters belong to.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from coordination.records import NotThereYet, ensure_dir, publish_record, read_record, remove_tree
from coordination.checkpoints import TRAINER_STATE, mark_complete
from train.config import LoRAConfig
from train.distributed import DistInfo, agreed
from train.lora import publish_lora
from train.model import Policy, named_master_params
from train.optim_state import save_optimizer_shard, shard_paths
from train.parallel import full_state_dict


def read_trainer_state(folder: Path) -> dict[str, Any] | None:
    """The trainer state saved with a checkpoint, or None for a folder without one (a base model)."""
    path = Path(folder) / TRAINER_STATE
    if not path.exists():
        return None
    try:
        return read_record(path, kind="trainer-state").data
    except NotThereYet as exc:
        raise RuntimeError(f"{path} is damaged ({exc}); remove it to start a fresh optimizer, or restore it") from None


def write_tokenizer(out: Path, tokenizer_source: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(str(out))


def write_hf_folder(policy: Policy, state_dict: dict[str, torch.Tensor], out: Path, tokenizer_source: Path) -> None:
    """Weights (safetensors), config, generation config and tokenizer: what vLLM serves as it is."""
    # save_pretrained drops tied duplicates from the dict it gets: hand it a copy (docs/design.md §10.4).
    policy.lm.save_pretrained(str(out), state_dict=dict(state_dict), safe_serialization=True)
    write_tokenizer(out, tokenizer_source)


def save_checkpoint(out: Path, *, policy: Policy, optimizer: torch.optim.Optimizer, info: DistInfo, backend: str,
                    run_id: str, iteration: int, tokenizer_source: Path, trainer_state: dict[str, Any],
                    lora: LoRAConfig | None = None, lora_record: dict[str, Any] | None = None) -> None:
    """Collective: write a complete checkpoint folder at `out` (rank 0 creates it beforehand).
    `lora` / `lora_record`: the run's LoRA settings and record (train.lora.WeightsSource.record)."""
    named = named_master_params(policy)
    has_state = any(optimizer.state.get(p) for _, p in named)

    def write_shard() -> None:
        if has_state:
            save_optimizer_shard(out, optimizer, named, rank=info.rank, world_size=info.world_size,
                                 backend=backend, run_id=run_id)

    agreed("writing optimizer state", info, write_shard)
    state_dict = full_state_dict(policy)

    def write_main() -> None:
        if not info.is_main:
            return
        weights: dict[str, torch.Tensor] | None = state_dict
        if lora is not None and lora.rank:
            weights = publish_lora(policy.lm.config, lora, Path(lora_record["base"]), state_dict, out)
        if weights is not None:
            write_hf_folder(policy, weights, out, tokenizer_source)
        else:
            write_tokenizer(out, tokenizer_source)
        publish_record(out / TRAINER_STATE, "trainer-state",
                       {**trainer_state, "world_size": info.world_size, "backend": backend,
                        "has_optimizer_state": has_state,
                        "lora": lora_record if lora is not None and lora.rank else None},
                       run_id=run_id, generation=0)
        shards = [p.relative_to(out).as_posix() for r in range(info.world_size) for p in shard_paths(out, r)]
        mark_complete(out, iteration=iteration, run_id=run_id, expected=shards if has_state else [])

    agreed("writing the checkpoint folder", info, write_main)


def prepare_output_dir(out: Path, info: DistInfo) -> None:
    """Rank 0 empties and creates `out`; callers follow with a collective before others write."""
    if info.is_main:
        remove_tree(out)  # never through a link planted at the staging folder
        ensure_dir(out)
