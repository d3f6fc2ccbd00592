"""LoRA through peft: which weights a run trains from, and what its checkpoints carry.

With `train.lora.rank > 0` peft injects adapters (A: r x in, B: out x r, B = 0 at the start)
into the `target_modules` of the loaded model and freezes every other weight; the policy module
keeps its Hugging Face names (plus `.base_layer` / `.lora_A.default` / `.lora_B.default`), so FSDP2
shards it like any model and only the adapters get gradients and optimizer state.

A run keeps training the same adapters on the same frozen base across iterations: a checkpoint
records the base it was trained on (trainer_state.json, `lora.base`) and holds the adapters in
`adapter/` (peft's format: adapter_config.json + adapter_model.safetensors, which vLLM's
/v1/load_lora_adapter accepts). The next iteration loads that base, loads the adapters and
resumes their Adam state. What the checkpoint serves depends on `lora.publish`: `merged` writes
the full weights with the adapters merged (each base weight merged by the rank that publishes it,
train/sharded.py, as peft's merge computes it), so the inference engine serves it as any
checkpoint; `adapters` writes only `adapter/` (rank 0, from the gathered adapters).
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordination.checkpoint_files import Stamp, check_stamp, open_listed, stamped
from coordination.checkpoints import ADAPTER_DIR, CheckpointError, stamp_of
from coordination.records import atomic_output
from rollout.adapter import WEIGHTS_FILE
from train.config import LoRAConfig
from train.lora_targets import check_targets_matched

_log = logging.getLogger("baton.train.lora")


@dataclass(frozen=True)
class WeightsSource:
    """Where a trainer takes its weights from: the full model to load, adapters to continue (or
    None for fresh ones), whether the input's optimizer state belongs to these trained parameters,
    and the `lora` record this run's checkpoints will carry (None without LoRA)."""

    base: Path
    adapter: Path | None
    resume_optimizer: bool
    record: dict[str, Any] | None


def _signature(record: dict[str, Any] | None) -> tuple | None:
    if not record:
        return None
    return int(record["rank"]), float(record["alpha"]), tuple(sorted(record["target_modules"]))


def lora_record(cfg: LoRAConfig, base: Path) -> dict[str, Any] | None:
    if not cfg.rank:
        return None
    return {"rank": cfg.rank, "alpha": cfg.alpha, "dropout": cfg.dropout, "target_modules": list(cfg.target_modules),
            "publish": cfg.publish, "base": str(base)}


def has_full_weights(folder: Path) -> bool:
    return (Path(folder) / "config.json").exists()


def weights_source(cfg: LoRAConfig, source: Path, trainer_state: dict[str, Any] | None) -> WeightsSource:
    """Decide what to load for training from checkpoint (or base model) `source`."""
    source = Path(source)
    saved = (trainer_state or {}).get("lora")
    wanted = lora_record(cfg, source)
    if saved and _signature(saved) == _signature(wanted):
        base = Path(saved["base"])
        if not has_full_weights(base):
            raise CheckpointError(f"the adapters in {source / ADAPTER_DIR} were trained on the base model {base}, "
                                  f"which is gone; restore it at that path to continue this LoRA run")
        return WeightsSource(base, source / ADAPTER_DIR, True, {**wanted, "base": str(base)})
    if not has_full_weights(source) and not saved:
        raise CheckpointError(f"{source} is not a Hugging Face model folder (no config.json); give a model or a "
                              f"checkpoint with full weights")
    if not has_full_weights(source):
        raise CheckpointError(
            f"{source} holds only LoRA adapters (train.lora.publish=adapters) trained with {_signature(saved)} "
            f"(rank, alpha, targets), but this run asks for {_signature(wanted) or 'no LoRA'}: keep the LoRA settings "
            f"of the run, or start from a checkpoint with full weights (train.lora.publish=merged)")
    if saved:
        _log.info("%s was trained with other LoRA settings (rank, alpha, targets: %s -> %s): training %s on its "
                  "merged weights with a fresh optimizer", source, _signature(saved), _signature(wanted),
                  "fresh adapters" if wanted else "every weight")
    elif wanted:
        _log.info("new LoRA adapters on %s (fresh optimizer)", source)
    return WeightsSource(source, None, not saved and not wanted, wanted)


def _peft_config(cfg: LoRAConfig):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none")


def inject_adapters(lm: nn.Module, cfg: LoRAConfig, adapter: Path | None) -> int:
    """Add adapters to `lm` in place (freezing the rest), loading `adapter` when given; returns
    the number of trainable parameters."""
    from peft import get_peft_model, set_peft_model_state_dict

    try:
        with warnings.catch_warnings():   # peft calls a transformers property that transformers 5 deprecates
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(lm, _peft_config(cfg))
    except ValueError as exc:
        raise CheckpointError(f"cannot add LoRA adapters to {type(lm).__name__}: {exc}; check "
                              f"train.lora.target_modules against the model's layer names") from None
    linear = {n.removesuffix(".base_layer").rsplit(".", 1)[-1] for n, m in lm.named_modules()
              if isinstance(m, nn.Linear) and ".lora_" not in n}
    check_targets_matched(cfg, list(peft_model.targeted_module_names), linear, type(lm).__name__)
    fresh_adapters_on_host(lm)
    if adapter is not None:
        path = adapter / WEIGHTS_FILE
        if not path.exists():
            raise CheckpointError(f"{path} is missing; the checkpoint's adapters are incomplete")
        result = set_peft_model_state_dict(peft_model, read_adapters(adapter))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise CheckpointError(f"the adapters in {adapter} do not fit this model (missing {missing[:3]}, "
                                  f"unexpected {list(result.unexpected_keys)[:3]})")
    if peft_model.base_model.model is not lm:
        raise RuntimeError("peft did not inject the adapters in place; the trainer relies on it")
    return sum(p.numel() for p in lm.parameters() if p.requires_grad)


def fresh_adapters_on_host(lm: nn.Module) -> None:
    """On a model built on the meta device (train/sharded.py) peft puts the new adapters on the
    base layers' device, so they hold no values; give them host memory and peft's own start
    values (A as nn.Linear's default, B = 0). They are small: the sharded load copies each rank's
    slice of them into place."""
    from peft.tuners.lora import LoraLayer

    for module in lm.modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = [getattr(module, name) for name in module.adapter_layer_names]
        if not any(p.is_meta for a in adapters for p in a.parameters()):
            continue
        for a in adapters:
            a.to_empty(device="cpu")
        for name in module.active_adapters:
            module.reset_lora_parameters(name, True)


@dataclass(frozen=True)
class MergeSource:
    """How one base weight is merged with its adapters for publication: W + scale * (B @ A)
    (transposed for fan-in-fan-out layers), as peft's merge computes it."""
    a: str          # parameter names in the policy's `lm`
    b: str
    scale: float
    transpose: bool

    def merged(self, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        delta = b.float() @ a.float()
        return weight.float() + (delta.T if self.transpose else delta) * self.scale


def merge_sources(lm: nn.Module) -> dict[str, MergeSource]:
    """Base weight name -> its MergeSource, for every LoRA linear layer in `lm`. Adapters on other
    layer kinds (embeddings, convolutions) are refused: the published merge covers linear layers."""
    from peft.tuners.lora import Linear, LoraLayer

    out: dict[str, MergeSource] = {}
    for name, module in lm.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, Linear):
            raise CheckpointError(f"LoRA on {name} ({type(module).__name__}) cannot be merged for publication; "
                                  f"target linear layers only in train.lora.target_modules, or set "
                                  f"train.lora.publish=adapters")
        for adapter in module.active_adapters:
            out[f"{name}.base_layer.weight"] = MergeSource(f"{name}.lora_A.{adapter}.weight",
                                                           f"{name}.lora_B.{adapter}.weight",
                                                           float(module.scaling[adapter]), bool(module.fan_in_fan_out))
    return out


def read_adapters(adapter: Path) -> dict[str, torch.Tensor]:
    """The tensors of `adapter/adapter_model.safetensors`, read from one fd that was opened without
    links and, for a checkpoint's adapters, checked to carry its marker's stamp."""
    from safetensors.torch import load

    owner = stamp_of(adapter.parent)
    if owner is None:  # adapters outside a checkpoint: the user's files, as a base model's are
        return load((adapter / WEIGHTS_FILE).read_bytes())
    fd, st = open_listed(adapter.parent, f"{ADAPTER_DIR}/{WEIGHTS_FILE}", owner)
    try:
        check_stamp(fd, adapter / WEIGHTS_FILE, adapter.parent, owner)
        return load(os.pread(fd, st.st_size, 0))
    finally:
        os.close(fd)


def write_adapters(config, cfg: LoRAConfig, base: Path, adapters: dict[str, torch.Tensor], out: Path,
                   stamp: Stamp) -> None:
    """Rank 0: write `out/adapter/` (peft's format, which vLLM loads) from the full adapter
    tensors `adapters` (names of the policy's `lm`), the weights stamped with `stamp`."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    # A skeleton on the meta device: the base weights are never needed, the adapters are assigned.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(skeleton, _peft_config(cfg))
    peft_model.peft_config["default"].base_model_name_or_path = str(base)  # get_peft_model sets the config's path
    skeleton.load_state_dict(adapters, strict=False, assign=True)
    left = [n for n, p in skeleton.named_parameters() if "lora_" in n and p.is_meta]
    if left:
        raise CheckpointError(f"the gathered adapters lack {left[:3]}; cannot write the LoRA checkpoint")
    peft_model.save_pretrained(str(out / ADAPTER_DIR), safe_serialization=True)
    # peft writes {"format": "pt"} as the metadata; the adapters are small, so they are stamped by
    # writing the file once more with the stamp in its header.
    path = out / ADAPTER_DIR / WEIGHTS_FILE
    head, body = stamped(path.read_bytes(), stamp)
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(head)
            fh.write(body)
