"""The tiny Qwen3-MoE model (`python -m train.tiny --moe`) trained by the real trainer."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import train_support as ts
from coordination.layout import RunLayout
from coordination.records import read_record
from coordination.checkpoints import is_complete, read_latest


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return ts.make_tiny(tmp_path_factory.mktemp("moe") / "tiny-moe", layers=2, experts=4, top_k=2)


def test_tiny_moe_cli_writes_a_qwen3_moe_that_transformers_loads_with_the_dense_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    assert ts.run_module("train.tiny", ["--out", str(out), "--moe", "--experts", "4", "--top-k", "2",
                                        "--layers", "2"], tmp_path / "tiny.log", timeout=120) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 2)
    assert model.config.moe_intermediate_size * 2 == model.config.intermediate_size
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 and experts.down_proj.shape[0] == 4
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok("1 + 2\n")["input_ids"], skip_special_tokens=True) == "1 + 2\n"


def test_tiny_moe_refuses_a_top_k_above_the_experts(tmp_path):
    assert ts.run_module("train.tiny", ["--out", str(tmp_path / "m"), "--moe", "--experts", "2", "--top-k", "3"],
                         tmp_path / "bad.log", timeout=60) == 2
    assert "--top-k (3) must be between 1 and --experts (2)" in (tmp_path / "bad.log").read_text()


def test_two_trainer_processes_train_the_moe_and_publish_every_expert_changed(moe, tmp_path):
    """ep=1 (every rank holds every expert, FSDP2 shards them like any weight): one iteration of
    4 steps on 2 torchrun processes publishes a checkpoint transformers loads, every tensor moved."""
    from transformers import AutoModelForCausalLM

    layout = RunLayout(tmp_path)
    ts.write_trajectories(layout, 1, moe)
    plan = ts.prepare(layout, 1, moe, 0, world_size=2)
    codes = ts.torchrun("train.trainer", ["--plan", str(plan)], tmp_path / "logs")
    assert codes == [0, 0], ts.logs_text(tmp_path / "logs")
    ts.publish(plan)
    assert read_latest(layout) == (1, layout.checkpoint(1))
    folder = layout.checkpoint(1)
    assert is_complete(folder)
    before = AutoModelForCausalLM.from_pretrained(str(moe)).state_dict()
    after = AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    assert before.keys() == after.keys()
    unchanged = [k for k, v in before.items() if torch.equal(v, after[k])]
    assert unchanged == []
    assert read_record(folder / "trainer_state.json").data["optimizer_step"] == 4
