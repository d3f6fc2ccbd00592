"""train.ep: the rules an expert-parallel degree must meet, refused with the value and the fix."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordination.config import ConfigError, from_dict
from train.config import TrainConfig, check_ep_experts, check_ep_world, check_ep_launch
from tests.test_run_cli import RUN, env


def test_ep_defaults_to_off_and_accepts_a_divisor_of_experts_and_world():
    assert TrainConfig().ep == 1
    check_ep_world(2, 4)
    check_ep_experts(2, 4, 4)
    check_ep_experts(1, None, 3)           # ep=1 is fine on a dense model


@pytest.mark.parametrize("call,message", [
    (lambda: check_ep_world(3, 4), "train.ep=3 does not divide the number of trainer processes (4 = nodes x "
                                   "train.nproc_per_node); set train.ep to one of [1, 2, 4]"),
    (lambda: check_ep_experts(4, 6, 8), "train.ep=4 does not divide the model's 6 experts per layer; every rank "
                                        "of an EP group holds num_experts / ep of them, so set train.ep to one of "
                                        "[1, 2]"),
    (lambda: check_ep_experts(2, None, 2), "train.ep=2 shards the experts of a mixture-of-experts model, but this "
                                           "model is dense"),
])
def test_impossible_degrees_are_refused_naming_the_rule_and_the_values_that_fit(call, message):
    with pytest.raises(ConfigError) as exc:
        call()
    assert message in str(exc.value)


@pytest.mark.parametrize("levers,named", [
    ({"backend": "ddp"}, "train.backend=ddp"),
    ({"dp_replicate": 2}, "train.dp_replicate=2"),
    ({"fsdp_cpu_offload": True}, "train.fsdp_cpu_offload=True"),
    ({"lora": {"rank": 4}}, "train.lora.rank=4"),
    ({"ep": 0}, "train.ep must be at least 1 (got 0)"),
])
def test_levers_expert_parallelism_does_not_combine_with_are_refused_in_the_config(levers, named):
    with pytest.raises(ConfigError) as exc:
        from_dict(TrainConfig, {"ep": 2, **levers})
    assert named in str(exc.value)


def _config(folder: Path, **fields) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


def test_launch_check_reads_the_experts_from_the_model_folder(tmp_path):
    moe = _config(tmp_path / "moe", model_type="qwen3_moe", num_experts=4)
    mixtral = _config(tmp_path / "mixtral", model_type="mixtral", num_local_experts=8)
    check_ep_launch(TrainConfig(ep=4, nproc_per_node=2), 2, moe)
    check_ep_launch(TrainConfig(ep=8, nproc_per_node=8), 1, mixtral)
    with pytest.raises(ConfigError, match="does not divide the model's 4 experts"):
        check_ep_launch(TrainConfig(ep=8, nproc_per_node=8), 1, moe)
    # a folder the node cannot see yet: only the world size is checked here, the trainer checks the rest
    check_ep_launch(TrainConfig(ep=2, nproc_per_node=2), 1, tmp_path / "absent")


@pytest.mark.parametrize("model,ep,message", [
    ({"model_type": "llama"}, 2, "train.ep=2 shards the experts of a mixture-of-experts model, but this model is dense"),
    ({"model_type": "qwen3_moe", "num_experts": 4}, 3, "train.ep=3 does not divide the number of trainer processes (2"),
    ({"model_type": "qwen3_moe", "num_experts": 6}, 4, "train.ep=4 does not divide the model's 6 experts per layer; "
                                                       "every rank of an EP group holds num_experts / ep of them, so "
                                                       "set train.ep to one of [1, 2]"),
])
def test_dry_run_refuses_an_impossible_ep_with_exit_2_before_writing_anything(tmp_path, model, ep, message):
    folder = _config(tmp_path / "model", **model)
    nodes = 2 if ep == 3 or model["model_type"] == "llama" else 4
    res = subprocess.run([RUN, "--data-path", str(tmp_path), "--log-path", str(tmp_path / "l"), "--rl-phase", "update",
                          "--num-nodes", str(nodes), "--rank-weights", ",".join(["1"] * nodes), "--master",
                          "--dry-run", f"model.path={folder}", f"train.ep={ep}"],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / "l").exists()
