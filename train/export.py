"""Writing a checkpoint folder from a running trainer (collective; used by RL and SFT).

Who writes what (docs/design.md §11.4):
- optimizer state: every rank its own DCP shard file (train/optim_state.py);
- weights: every rank its share of the parameters, gathered and cast to the serving dtype (the
  dtype the trainer computes in: bfloat16 on CUDA by default, float32 on CPU), as one safetensors
  file; rank 0 also the index (train/sharded.py);
- rank 0: config.json, generation_config.json, the tokenizer, `trainer_state.json` and, last,
  the completeness marker, after all ranks agreed that their files are written. A failure (or
  a kill) anywhere leaves a folder without a marker, which publication refuses.

With LoRA (train/lora.py) rank 0 writes the adapters to `adapter/` and, unless
`lora.publish=adapters`, every rank writes its share of the full weights with the adapters
merged into each base weight by its owner; `trainer_state.json` records the LoRA settings and
the base model the adapters belong to.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from coordination.checkpoint_files import Stamp
from coordination.checkpoints import TRAINER_STATE, mark_complete
from coordination.records import NotThereYet, ensure_dir, publish_record, read_record, remove_tree
from train.config import LoRAConfig
from train.distributed import DistInfo, agreed, all_reduce_sum
from train.lora import merge_sources, write_adapters
from train.model import Policy
from train.optim_state import OPTIMIZER_DIR, has_state as optimizer_has_state, save_optimizer_state, shard_file
from train.sharded import gather_adapters, gather_share, write_config, write_share


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


def reshard(policy: Policy) -> None:
    """Put every FSDP2 unit back into its sharded state. After a forward that FSDP2 does not
    reshard (the root's, e.g. SFT's evaluation by generate) the modules expose the gathered
    tensors instead of the sharded parameters the optimizer holds, and DCP could not match them."""
    from torch.distributed.fsdp import FSDPModule

    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def save_checkpoint(out: Path, *, policy: Policy, optimizer: torch.optim.Optimizer, info: DistInfo, backend: str,
                    run_id: str, iteration: int, tokenizer_source: Path, trainer_state: dict[str, Any],
                    lora: LoRAConfig | None = None, lora_record: dict[str, Any] | None = None,
                    defer_optimizer: bool = False) -> bool:
    """Collective: write a complete checkpoint folder at `out` (rank 0 creates it beforehand).
    `lora` / `lora_record`: the run's LoRA settings and record (train.lora.WeightsSource.record).
    With `defer_optimizer` the folder holds no optimizer state and its trainer state says the state
    follows (`optimizer_deferred`): the caller writes it into optimizer/ later (OptimizerWrite).
    Returns whether the optimizer has state (so there is something to write)."""
    use_lora = lora is not None and bool(lora.rank)
    stamp = Stamp(run_id, iteration)  # in every safetensors file's metadata: whose file it is, checked at load
    reshard(policy)
    # Every rank decides alike: optimizer state exists after the first step on all ranks or none.
    has_state = all_reduce_sum([1.0 if optimizer_has_state(optimizer) else 0.0], info.device)[0] == info.world_size
    expected: list[str] = []
    if has_state and not defer_optimizer:
        wrote = save_optimizer_state(out, policy, optimizer, info.rank, stamp)
        flags = [0.0] * info.world_size
        flags[info.rank] = 1.0 if wrote else 0.0
        expected += [f"{OPTIMIZER_DIR}/{shard_file(r)}"
                     for r, f in enumerate(all_reduce_sum(flags, info.device)) if f]
    dtype = getattr(policy, "serving_dtype", torch.float32)
    adapters = gather_adapters(policy, info.rank) if use_lora else {}
    full_weights = not use_lora or lora.publish == "merged"
    if full_weights:
        share = gather_share(policy, info.rank, info.world_size, dtype,
                             merge=merge_sources(policy.lm) if use_lora else None)
        expected += share.files
        agreed("writing the weights", info, lambda: write_share(share, out, info.rank, stamp))

    def write_main() -> None:
        if not info.is_main:
            return
        if use_lora:
            write_adapters(policy.lm.config, lora, Path(lora_record["base"]), adapters, out, stamp)
        if full_weights:
            write_config(policy, out, dtype)
        write_tokenizer(out, tokenizer_source)
        publish_record(out / TRAINER_STATE, "trainer-state",
                       {**trainer_state, "world_size": info.world_size, "backend": backend,
                        "has_optimizer_state": has_state, "optimizer_deferred": has_state and defer_optimizer,
                        "weights_dtype": str(dtype).removeprefix("torch."),
                        "lora": lora_record if use_lora else None},
                       run_id=run_id, generation=0)
        mark_complete(out, iteration=iteration, run_id=run_id, expected=expected)

    agreed("writing the checkpoint folder", info, write_main)
    return has_state


def prepare_output_dir(out: Path, info: DistInfo) -> None:
    """Rank 0 empties and creates `out`; callers follow with a collective before others write."""
    if info.is_main:
        remove_tree(out)  # never through a link planted at the staging folder
        ensure_dir(out)
