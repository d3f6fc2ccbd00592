"""What a Hugging Face config.json says that both the engines and the trainer must know: how many
experts an MoE layer has. The trainer shards them (train.ep); vLLM on CPU cannot reload them in
place (rollout/engines/vllm_engine.py). One reading of the keys for both."""
from __future__ import annotations

# Where the MoE families of transformers write their experts per layer in config.json
# (Qwen2/3-MoE, OLMoE: num_experts; Mixtral: num_local_experts).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def model_experts(config: dict) -> int | None:
    """Experts per MoE layer named by a model config (config.json's dict), None for a dense model."""
    for key in EXPERT_COUNT_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    return None
