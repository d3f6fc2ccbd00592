"""The levers around mixture-of-experts models: which families expert parallelism takes, LoRA
targets that MoE blocks lack (at ep=1 too), and the levers EP does not combine with; each refused
with the value, the rule and the fix, at dry run (exit 2) where config.json is enough."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordination.config import ConfigError, from_dict
from tests import train_support as ts
from tests.test_run_cli import RUN, env
from train.config import LoRAConfig, TrainConfig, check_ep_launch
from train.lora_targets import check_moe_lora_targets


def _config(folder: Path, **fields) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def _dry_run(tmp_path: Path, folder: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([RUN, "--data-path", str(tmp_path), "--log-path", str(tmp_path / "l"), "--rl-phase",
                           "update", "--num-nodes", "2", "--rank-weights", "1,1", "--master", "--dry-run",
                           f"model.path={folder}", *overrides], env=env(), capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "olmoe", "deepseek_v3"])
def test_ep_refuses_moe_families_it_was_not_built_for(tmp_path, model_type):
    folder = _config(tmp_path / model_type, model_type=model_type, num_experts=4)
    with pytest.raises(ConfigError, match=f"supports the model families qwen3_moe, mixtral, not '{model_type}'"):
        check_ep_launch(TrainConfig(ep=2, nproc_per_node=2), 1, folder)
    check_ep_launch(TrainConfig(ep=1, nproc_per_node=2), 1, folder)


def test_dry_run_refuses_ep_on_another_family_with_exit_2(tmp_path):
    folder = _config(tmp_path / "model", model_type="olmoe", num_experts=4)
    res = _dry_run(tmp_path, folder, "train.ep=2")
    assert res.returncode == 2, res.stderr
    assert "supports the model families qwen3_moe, mixtral, not 'olmoe'" in res.stderr
    assert not (tmp_path / "l").exists()


def test_lora_expert_names_are_refused_on_an_all_moe_model_and_kept_where_dense_mlps_exist():
    lora = LoRAConfig(rank=4)                                    # the defaults name gate/up/down_proj
    with pytest.raises(ConfigError) as exc:
        check_moe_lora_targets(lora, {"model_type": "mixtral", "num_local_experts": 8})
    assert "names gate_proj, up_proj, down_proj" in str(exc.value)
    assert "train.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]" in str(exc.value)
    check_moe_lora_targets(LoRAConfig(rank=4, target_modules=["q_proj", "o_proj"]),
                           {"model_type": "mixtral", "num_local_experts": 8})
    check_moe_lora_targets(lora, {"model_type": "qwen3_moe", "num_experts": 8, "mlp_only_layers": [0]})
    check_moe_lora_targets(lora, {"model_type": "llama"})
    check_moe_lora_targets(LoRAConfig(rank=0), {"model_type": "mixtral", "num_local_experts": 8})


def test_dry_run_refuses_lora_on_experts_at_ep1_with_exit_2(tmp_path):
    folder = _config(tmp_path / "model", model_type="qwen3_moe", num_experts=4)
    res = _dry_run(tmp_path, folder, "train.lora.rank=4")
    assert res.returncode == 2, res.stderr
    assert "names gate_proj, up_proj, down_proj" in res.stderr and "LoRA on experts is not implemented" in res.stderr


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lora_injection_refuses_targets_that_match_no_layer_and_adapts_the_ones_that_do(tmp_path, family):
    from transformers import AutoModelForCausalLM

    from train.lora import inject_adapters

    path = ts.make_tiny(tmp_path / family, layers=1, experts=4, top_k=2, family=family)
    with pytest.raises(ConfigError) as exc:
        inject_adapters(AutoModelForCausalLM.from_pretrained(str(path)), LoRAConfig(rank=4), None)
    assert "names gate_proj, up_proj, down_proj, which no layer of" in str(exc.value)
    assert "q_proj" in str(exc.value).split("its linear layers are")[1]
    lm = AutoModelForCausalLM.from_pretrained(str(path))
    trained = inject_adapters(lm, LoRAConfig(rank=4, target_modules=["q_proj", "v_proj"]), None)
    assert trained == sum(p.numel() for n, p in lm.named_parameters() if ".lora_" in n) > 0


@pytest.mark.parametrize("levers,named", [
    ({"dp_replicate": 2}, "train.dp_replicate=2"),
    ({"fsdp_cpu_offload": True}, "train.fsdp_cpu_offload=True"),
    ({"lora": {"rank": 4}}, "train.lora.rank=4"),
])
def test_ep_with_hsdp_cpu_offload_or_lora_is_refused_with_the_reason(levers, named):
    with pytest.raises(ConfigError) as exc:
        from_dict(TrainConfig, {"ep": 2, **levers})
    assert named in str(exc.value) and "not implemented" in str(exc.value)
