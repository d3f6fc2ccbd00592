"""The memory plan's model shape counts the experts of an MoE model (not a dense MLP)."""
from __future__ import annotations

import torch

from train.model_shape import ModelShape

COMMON = dict(vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
              head_dim=32, tie_word_embeddings=False)


def _count(config) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_mixtral_parameters_equal_the_models():
    from transformers import MixtralConfig

    config = MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    shape = ModelShape.from_dict(config.to_dict())
    assert shape.params == _count(config)
    assert shape.expert_params == 4 * 3 * 64 * 48


def test_qwen3_moe_with_a_dense_layer_counts_every_parameter_but_the_qk_norms():
    """mlp_only_layers keeps layer 1 dense; the plan leaves out Qwen3's q_norm and k_norm (head_dim
    each per layer), as it does for dense Qwen3."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                            mlp_only_layers=[1], **COMMON)
    shape = ModelShape.from_dict(config.to_dict())
    assert (shape.experts, shape.expert_intermediate, shape.dense_layers) == (4, 48, 1)
    assert _count(config) - shape.params == 3 * 2 * 32
    assert shape.block_params > shape._block(sparse=False)      # the largest block is a sparse one


def test_a_dense_model_has_no_experts():
    shape = ModelShape.from_dict({**COMMON, "intermediate_size": 96})
    assert (shape.experts, shape.expert_params) == (0, 0)
    # q, o 64x64; k, v 64x32; MLP 3 x 64x96; two norms
    assert shape.block_params == 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64
    assert shape.params == 3 * shape.block_params + 2 * 64 * 64 + 64
