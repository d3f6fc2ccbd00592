"""train.cp: the rules a context-parallel degree must meet, refused with the value and the fix,
in the config, at launch and by the dry run (exit 2, rule context-parallel-degree)."""
from __future__ import annotations

import subprocess

import pytest

from coordination.config import ConfigError, from_dict
from tests.test_run_cli import RUN, env
from tests.test_train_ep_config import _config
from train.config import TrainConfig
from train.context_rules import check_cp_heads, check_cp_launch, check_cp_node, check_cp_world

LLAMA = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8}


def test_cp_defaults_to_off_and_accepts_divisors_of_node_world_and_heads():
    assert TrainConfig().cp == 1
    check_cp_world(4, 8)
    check_cp_node(4, 8)
    check_cp_heads(8, LLAMA, "sdpa")
    check_cp_heads(1, {"model_type": "gemma2", "layer_types": ["sliding_attention"]}, "eager")  # cp=1: no split


@pytest.mark.parametrize("call,message", [
    (lambda: check_cp_world(3, 4), "train.cp=3 does not divide the number of trainer processes (4 = nodes x "
                                   "train.nproc_per_node); set train.cp to one of [1, 2, 4]"),
    (lambda: check_cp_node(4, 2), "train.cp=4 would split a sequence across nodes: a CP group must stay within one "
                                  "node's 2 trainer processes (train.nproc_per_node); set train.cp to one of [1, 2]"),
    (lambda: check_cp_heads(16, LLAMA, "sdpa"), "train.cp=16 does not divide the model's num_key_value_heads 8: "
                                                "every rank of a CP group attends with heads/cp query heads and "
                                                "kv_heads/cp kv heads; set train.cp to one of [1, 2, 4, 8]"),
    (lambda: check_cp_heads(2, {"model_type": "x", "num_attention_heads": 6, "num_key_value_heads": 3}, "sdpa"),
     "does not divide the model's num_key_value_heads 3"),
    (lambda: check_cp_heads(2, {"model_type": "gemma2", "num_attention_heads": 8,
                                "layer_types": ["sliding_attention", "full_attention"]}, "sdpa"),
     "train.cp=2: gemma2's attention is not plain causal attention (layer types ['full_attention', "
     "'sliding_attention'])"),
    (lambda: check_cp_heads(2, {"model_type": "mistral", "num_attention_heads": 8, "sliding_window": 4096}, "sdpa"),
     "mistral's attention is not plain causal attention"),
    (lambda: check_cp_heads(2, {"model_type": "deepseek_v3", "num_attention_heads": 128, "kv_lora_rank": 512},
                            "sdpa"), "deepseek_v3 compresses keys and values (multi-head latent attention"),
    (lambda: check_cp_heads(2, LLAMA, "eager"), "train.cp=2 runs attention through PyTorch's SDPA on each rank's "
                                                "heads, but train.attn=eager; set train.attn=sdpa or train.cp=1"),
])
def test_impossible_degrees_and_unsplittable_attention_are_refused_with_the_rule(call, message):
    with pytest.raises(ConfigError) as exc:
        call()
    assert message in str(exc.value)


def test_a_qwen2_config_with_sliding_window_switched_off_is_plain_attention():
    check_cp_heads(2, {"model_type": "qwen2", "num_attention_heads": 8, "num_key_value_heads": 2,
                       "sliding_window": 4096, "use_sliding_window": False}, "sdpa")
    # layer_types, where a config has them, decide: a window size alone does not slide.
    check_cp_heads(2, {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2,
                       "sliding_window": 4096, "layer_types": ["full_attention"] * 4}, "sdpa")


@pytest.mark.parametrize("levers,named", [
    ({"backend": "ddp"}, "train.backend=ddp"),
    ({"dp_replicate": 2}, "train.dp_replicate=2"),
    ({"ep": 2}, "train.ep=2"),
    ({"compile": {}}, "train.compile="),
    ({"attn": "eager"}, "train.attn=eager"),
    ({"cp": 0}, "train.cp must be at least 1 (got 0)"),
])
def test_levers_context_parallelism_does_not_combine_with_are_refused_in_the_config(levers, named):
    with pytest.raises(ConfigError) as exc:
        from_dict(TrainConfig, {"cp": 2, **levers})
    assert named in str(exc.value)


def test_launch_check_reads_the_heads_from_the_model_folder(tmp_path):
    model = _config(tmp_path / "m", **LLAMA)
    check_cp_launch(TrainConfig(cp=4, nproc_per_node=8), 2, model)
    with pytest.raises(ConfigError, match="num_key_value_heads 8"):
        check_cp_launch(TrainConfig(cp=16, nproc_per_node=16), 1, model)
    # a folder the node cannot see yet: the node and world rules only; the trainer checks the heads
    check_cp_launch(TrainConfig(cp=2, nproc_per_node=2), 1, tmp_path / "absent")


def test_ring_needs_no_head_count_that_cp_divides_and_ulysses_points_to_it(tmp_path):
    three = {"model_type": "llama", "num_attention_heads": 3, "num_key_value_heads": 1}
    check_cp_heads(2, three, "sdpa", "ring")
    with pytest.raises(ConfigError, match=r"set train.cp to one of \[1\], or train.cp_kind=ring"):
        check_cp_heads(2, three, "sdpa", "ulysses")
    # ring splits the same plain causal attention: what is not that is refused for it too
    with pytest.raises(ConfigError, match="not plain causal attention"):
        check_cp_heads(2, {**three, "sliding_window": 64}, "sdpa", "ring")
    model = _config(tmp_path / "m", **three)
    check_cp_launch(TrainConfig(cp=2, nproc_per_node=2, cp_kind="ring"), 1, model)
    assert TrainConfig().cp_kind == "ulysses"
    with pytest.raises(ConfigError, match="cp_kind"):
        from_dict(TrainConfig, {"cp": 2, "cp_kind": "zigzag"})


@pytest.mark.parametrize("model,cp,nproc,message", [
    (LLAMA, 4, 2, "context-parallel-degree: train.cp=4 would split a sequence across nodes"),
    ({"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 6}, 4, 4,
     "context-parallel-degree: train.cp=4 does not divide the model's num_attention_heads 6 and "
     "num_key_value_heads 6"),
])
def test_dry_run_refuses_an_impossible_cp_with_exit_2_naming_the_rule(tmp_path, model, cp, nproc, message):
    folder = _config(tmp_path / "model", **model)
    res = subprocess.run([RUN, "--data-path", str(tmp_path), "--log-path", str(tmp_path / "l"), "--rl-phase", "update",
                          "--num-nodes", "2", "--rank-weights", "1,1", "--master", "--dry-run",
                          f"model.path={folder}", f"train.cp={cp}", f"train.nproc_per_node={nproc}"],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / "l").exists()


def test_dry_run_prints_the_mesh_with_cp_and_passes_the_rule(tmp_path):
    folder = _config(tmp_path / "model", **LLAMA)
    res = subprocess.run([RUN, "--data-path", str(tmp_path), "--log-path", str(tmp_path / "l"), "--rl-phase", "update",
                          "--num-nodes", "2", "--rank-weights", "1,1", "--master", "--dry-run",
                          f"model.path={folder}", "train.cp=4", "train.nproc_per_node=8"],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert "mesh: 16 trainer processes = dp 4 x cp 4 (ulysses)" in res.stdout, res.stdout
    assert "context-parallel-degree" not in res.stdout + res.stderr
