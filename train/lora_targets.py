"""Which layers LoRA's `target_modules` reach, checked before a run trains something else.

peft adds adapters to the modules whose names end in a target and quietly skips targets that
match nothing. The defaults name the MLP's gate_proj/up_proj/down_proj, which a dense model has;
a mixture-of-experts block holds its experts as stacked [experts, ...] tensors (Qwen3-MoE,
Mixtral in transformers 5), not linear layers, so those targets would adapt nothing and the run
would train the attention alone. LoRA on experts is not implemented: both checks refuse instead.
"""
from __future__ import annotations

from coordination.config import ConfigError
from rollout.model_config import model_experts
from train.config import LoRAConfig

# The per-expert linear names of the MoE families' checkpoints (Qwen2/3-MoE, OLMoE; Mixtral).
EXPERT_LINEAR_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def has_dense_mlp_layers(config: dict) -> bool:
    """Whether some decoder layers of an MoE config keep a dense MLP (Qwen's mlp_only_layers or a
    decoder_sparse_step above 1), whose linear layers LoRA can adapt."""
    return bool(config.get("mlp_only_layers")) or int(config.get("decoder_sparse_step") or 1) > 1


def check_moe_lora_targets(cfg: LoRAConfig, config: dict) -> None:
    """From config.json alone (the dry run): refuse expert MLP names as LoRA targets of a model
    whose every MLP is a mixture-of-experts block."""
    if not cfg.rank or model_experts(config) is None or has_dense_mlp_layers(config):
        return
    named = [t for t in cfg.target_modules if t in EXPERT_LINEAR_NAMES]
    if named:
        kept = [t for t in cfg.target_modules if t not in EXPERT_LINEAR_NAMES] or ["q_proj", "v_proj"]
        raise ConfigError(
            f"train.lora.target_modules names {', '.join(named)}, but every MLP of this {config.get('model_type')} "
            f"model is a mixture-of-experts block whose experts are stacked tensors, not linear layers: LoRA on "
            f"experts is not implemented and those targets would adapt nothing; set "
            f"train.lora.target_modules=[{','.join(kept)}] or train without LoRA (train.lora.rank=0)")


def check_targets_matched(cfg: LoRAConfig, targeted: list[str], linear_names: set[str], model: str) -> None:
    """After injection: every target must have reached some module (`targeted`: the full names of
    the modules peft adapted; `linear_names`: the last name part of every linear layer of `model`)."""
    unmatched = [t for t in cfg.target_modules if not any(n == t or n.endswith(f".{t}") for n in targeted)]
    if unmatched:
        raise ConfigError(
            f"train.lora.target_modules names {', '.join(unmatched)}, which no layer of {model} has (a "
            f"mixture-of-experts block holds its experts as stacked tensors, which LoRA does not adapt); "
            f"its linear layers are {', '.join(sorted(linear_names))}: remove the others from "
            f"train.lora.target_modules")
