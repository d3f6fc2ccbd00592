"""LoRA through the real trainer (`python -m train.trainer --plan`): what its checkpoints hold and
how the next iteration continues the same adapters."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import train_support as ts
from coordination.layout import RunLayout
from coordination.records import read_record
from coordination.checkpoints import is_complete

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}
SCALE = LORA["alpha"] / LORA["rank"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ts.make_tiny(tmp_path_factory.mktemp("base") / "tiny", layers=2)


@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    """Iteration 1 (merged checkpoint) and iteration 2 (adapters only) of a LoRA run."""
    layout = RunLayout(tmp_path_factory.mktemp("run"))
    ts.write_trajectories(layout, 1, base)
    plan = ts.prepare(layout, 1, base, 0, lora=LORA)
    rc1 = ts.run_module("train.trainer", ["--plan", str(plan)], layout.root / "iter1.log")
    rc2 = None
    if rc1 == 0:
        ts.publish(plan)
        ts.write_trajectories(layout, 2, layout.checkpoint(1), seed=1, policy_iteration=1)
        plan2 = ts.prepare(layout, 2, layout.checkpoint(1), 1, lora={**LORA, "publish": "adapters"})
        rc2 = ts.run_module("train.trainer", ["--plan", str(plan2)], layout.root / "iter2.log")
        if rc2 == 0:
            ts.publish(plan2)
    return layout, rc1, rc2


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


def _log(layout: RunLayout, name: str) -> str:
    return (layout.root / name).read_text()


def test_merged_checkpoint_is_base_plus_scaled_adapters_and_loads_in_transformers(base, run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    layout, rc1, _ = run
    assert rc1 == 0, _log(layout, "iter1.log")
    folder = layout.checkpoint(1)
    assert is_complete(folder)
    merged, initial, adapter = ts.load_weights(folder), ts.load_weights(base), _adapter(folder)
    assert merged.keys() == initial.keys()             # plain Hugging Face names: served as any checkpoint
    adapted = set()
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        layer = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        assert b.abs().max() > 0                       # trained away from B = 0
        expected = initial[layer + ".weight"] + SCALE * b @ a
        assert torch.allclose(merged[layer + ".weight"], expected, atol=1e-6), layer
        adapted.add(layer + ".weight")
    assert len(adapted) == 3 * 2                        # 3 target modules x 2 blocks
    assert all(torch.equal(merged[k], initial[k]) for k in initial if k not in adapted)

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert model.config.tie_word_embeddings is True     # the base model's config, unchanged
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(base)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)),
                                          str(folder / "adapter")).eval()
    ids = torch.tensor([[1, 20, 21, 22, 30, 40]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)


def test_only_adapters_have_optimizer_state_and_the_state_records_the_base(base, run):
    layout, rc1, _ = run
    assert rc1 == 0
    names = {key.split("::")[0] for key in ts.optimizer_tensors(layout.checkpoint(1))}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    state = read_record(layout.checkpoint(1) / "trainer_state.json").data
    assert state["lora"]["base"] == str(base) and state["lora"]["rank"] == 4


def test_next_iteration_continues_the_adapters_and_their_optimizer_and_can_publish_adapters_only(base, run):
    layout, rc1, rc2 = run
    assert rc1 == 0 and rc2 == 0, _log(layout, "iter2.log")
    assert "optimizer step 4)" in _log(layout, "iter2.log")             # Adam state resumed
    folder = layout.checkpoint(2)
    assert is_complete(folder)
    assert not (folder / "model.safetensors").exists() and not (folder / "config.json").exists()
    state = read_record(folder / "trainer_state.json").data
    assert state["optimizer_step"] == 8 and state["lora"]["base"] == str(base)
    first, second = _adapter(layout.checkpoint(1)), _adapter(folder)
    assert first.keys() == second.keys()
    # The same adapters trained further: the A matrices moved from iteration 1's values (a fresh
    # start would draw new random A's, which are far away).
    for key in (k for k in first if ".lora_A." in k):
        step = (second[key] - first[key]).abs().max().item()
        assert 0 < step < 0.01, (key, step)
