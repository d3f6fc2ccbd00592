"""Stacked expert tensors are published under the per-expert names transformers itself writes."""
from __future__ import annotations

import pytest
import torch

from train.expert_layout import checkpoint_tensors


def _tiny(model_type: str):
    from transformers import MixtralConfig, Qwen3MoeConfig, AutoModelForCausalLM

    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, tie_word_embeddings=False)
    if model_type == "mixtral":
        config = MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common)
    else:
        config = Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                **common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_per_expert_names_and_values_equal_what_save_pretrained_writes(model_type, tmp_path):
    from safetensors.torch import load_file

    lm = _tiny(model_type)
    lm.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = {}
    for name, t in lm.state_dict().items():
        ours.update(checkpoint_tensors(model_type, name, t))
    assert ours.keys() == saved.keys()
    assert all(torch.equal(ours[k], saved[k]) for k in saved)
    assert sum(".experts.3." in k for k in ours) == 2 * 3       # 2 layers x (gate, up, down)


def test_a_slice_of_experts_keeps_the_layer_numbering():
    stacked = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    out = dict(checkpoint_tensors("qwen3_moe", "model.layers.1.mlp.experts.gate_up_proj", stacked, first_expert=2))
    assert list(out) == [f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in (2, 3) for p in ("gate_proj", "up_proj")]
    assert torch.equal(out["model.layers.1.mlp.experts.3.up_proj.weight"], stacked[1, 2:])


def test_families_without_a_layout_here_keep_the_stacked_tensor():
    stacked = torch.zeros(4, 6, 3)
    assert checkpoint_tensors("some_moe", "model.layers.0.mlp.experts.down_proj", stacked) == \
        [("model.layers.0.mlp.experts.down_proj", stacked)]
