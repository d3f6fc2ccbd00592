"""The GPU memory plan (train/memory_plan.py, docs/design.md §10.5): the worked 7B example, the
levers moving the estimate the right way, and scripts/run.sh refusing an engine and a trainer that
cannot share the GPUs, before anything is written and without loading weights."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from rl.runconfig import load_run_config
from tests.procs import ROOT, env
from train.memory_plan import GIB, ModelShape, make_plan, trainer_memory

GPU_EXAMPLE = ROOT / "configs" / "gpu-example.yaml"
# Llama-2-7B's sizes: what the plan needs from config.json, and no weights.
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}

# The worked example of docs/design.md §10.5 computed by hand (GiB = 2^30 bytes): 8 x 80 GiB, one node,
# FSDP2 over 8, bf16 compute with fp32 master weights and AdamW state, every block checkpointed,
# 32768 tokens per micro-batch, LM head in chunks of 512 tokens.
#   block  = 4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096          = 202,383,360
#   P      = 32 x block + 2 x 32000 x 4096 + 4096               = 6,738,415,616
#   params 4P/8 = 3.138; gathered 2 x (262,148,096 + 2 x block) = 1.242; grads 4P/8 + 4 x block = 3.892
#   AdamW 8P/8 = 6.276; activations per token: 32 x 2 x 4096 (block inputs) + 186,496 (one block
#   recomputed: 20h + 4kv + 8i + 4 heads) + 8 x 4096 (final norm) = 481,408 B x 32768 = 14.691
#   LM head 3 x 4 x 512 x 32000 + 8 x 32768 = 0.183; fixed 3.0  -> peak 32.42
#   vLLM weights 2P = 12.551; KV cache 0.9 x 80 - 12.551 - 2 = 57.449 (2 x 32 x 4096 x 2 = 0.5 MiB/token)
WORKED = {"parameters": 3.138, "gathered": 1.242, "gradients": 3.892, "AdamW": 6.276, "activations": 14.691,
          "LM head": 0.183, "peak": 32.42, "weights": 12.551, "kv_cache": 57.449}


def _model(tmp_path: Path, config: dict = LLAMA_7B) -> Path:
    """The model's config.json and a tokenizer (the dry run measures prompts with it), no weights."""
    from train.tiny import build_tokenizer

    model = tmp_path / "model-7b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    if not (model / "tokenizer.json").exists():
        build_tokenizer().save_pretrained(model)
    return model


def _cfg(model: Path, *overrides: str):
    return load_run_config([GPU_EXAMPLE], [f"model.path={model}", "train.gpu_memory_gib=80", *overrides])


def test_plan_of_a_7b_model_on_8_gpus_of_80_gib_matches_the_worked_example(tmp_path):
    cfg = _cfg(_model(tmp_path), "inference.vllm.gpu_memory_utilization=0.9")
    plan = make_plan(cfg, "both", 1)
    assert plan.shape.params == 6_738_415_616 and plan.world_size == 8
    rows = {name.split(":")[0].split(" ")[0]: b / GIB for name, b in plan.trainer.rows}
    got = {"parameters": rows["parameters"], "gathered": rows["gathered"], "gradients": rows["gradients"],
           "AdamW": rows["AdamW"], "activations": rows["activations"], "LM head": rows["LM"],
           "peak": plan.trainer.peak / GIB, "weights": plan.engine.weights / GIB,
           "kv_cache": plan.engine.kv_cache / GIB}
    for key, want in WORKED.items():
        assert got[key] == pytest.approx(want, rel=0.15), key
    assert plan.shared and plan.fits  # gpu-example.yaml sleeps the engine while training


def test_levers_move_the_trainer_estimate_the_way_they_move_memory():
    shape = ModelShape.from_dict(LLAMA_7B)
    base = load_run_config([GPU_EXAMPLE], []).train

    def peak(**change) -> float:
        return trainer_memory(shape, replace(base, **change), 8).peak

    no_ac = peak(ac=replace(base.ac, freq=0))
    assert no_ac > 5 * peak()                                         # 32k tokens without AC: ~183 GiB more
    assert peak(ac=replace(base.ac, freq=2)) < no_ac                  # every other block
    assert peak(micro_batch_tokens=8192) < peak()
    assert peak(fsdp_cpu_offload=True) < peak(optim_cpu_offload=True) < peak()
    assert peak(dp_replicate=2) > peak()                              # shards over 4 instead of 8
    assert peak(lora=replace(base.lora, rank=16)) < peak()            # no full gradients or AdamW state
    assert peak(kl_coef=0.1) > peak()                                 # the reference policy's shard
    assert peak(fused_lm_head_token_chunk_size="disabled") > peak() + 5 * GIB  # [32768, 32000] logits
    ddp = peak(backend="ddp")
    assert ddp > 6.7e9 * 20 - 1                                       # replicated: 4+2+8+8 B per parameter


def test_engine_residue_during_training_follows_between_iterations(tmp_path):
    model = _model(tmp_path)
    during = {}
    for mode in ("reload", "sleep", "restart"):
        plan = make_plan(_cfg(model, f"inference.between_iterations={mode}"), "both", 1)
        during[mode] = (plan.shared, plan.training_total / GIB)
    trainer = make_plan(_cfg(model), "update", 1)
    assert trainer.engine is None and not trainer.shared
    assert during["restart"] == (False, pytest.approx(trainer.trainer.peak / GIB))
    assert during["sleep"][0] and during["sleep"][1] == pytest.approx(trainer.trainer.peak / GIB + 2.0)
    assert during["reload"][0] and during["reload"][1] == pytest.approx(trainer.trainer.peak / GIB + 0.85 * 80)


def _dry_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    from rollout.tasks import arithmetic_tasks, write_tasks

    data = tmp_path / "data"
    if not data.exists():
        data.mkdir()
        train, ev = arithmetic_tasks(512, 10, digits=2, seed=3)  # the GPU example's tasks_per_iteration
        write_tasks(data / "train.jsonl", train)
        write_tasks(data / "eval.jsonl", ev)
    cmd = [str(ROOT / "scripts/run.sh"), "--data-path", str(data), "--log-path", str(tmp_path / "run"),
           "--rl-phase", "both", "--eval-interval", "0", "--dry-run", "--config", str(GPU_EXAMPLE),
           f"model.path={_model(tmp_path)}", "train.gpu_memory_gib=80", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def test_reload_beside_the_trainer_is_refused_with_its_numbers_and_the_settings_that_fit(tmp_path):
    res = _dry_run(tmp_path, "inference.between_iterations=reload", "inference.vllm.gpu_memory_utilization=0.9")
    assert res.returncode == 2, res.stdout + res.stderr
    err = " ".join(res.stderr.split())
    assert "trainer (32.4 GiB peak per GPU)" in err and "(72.0 GiB = gpu_memory_utilization 0.9 x 80.0 GiB)" in err
    assert "need 104.4 GiB of the 80.0 GiB per GPU" in err
    assert "inference.between_iterations=sleep (trainer 32.4 + asleep engine 2.0 GiB)" in err
    assert "inference.vllm.gpu_memory_utilization=0.59" in err
    assert "train.fsdp_cpu_offload" not in err  # not enough beside a 72 GiB server: not offered
    assert not (tmp_path / "run").exists()


def test_gpu_example_with_sleep_passes_and_dry_run_prints_the_plan_without_weights(tmp_path):
    before = sorted(p.name for p in _model(tmp_path).iterdir())
    assert "config.json" in before and not any(name.endswith(".safetensors") for name in before)
    res = _dry_run(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    plan = res.stdout.split("## memory plan per GPU", 1)[1]
    assert "6.74B parameters" in plan and "between_iterations=sleep (level 2)" in plan
    assert "of 80.0 GiB: fits" in plan and "34.42" in plan
    assert max(len(line) for line in plan.splitlines()) <= 100
    assert sorted(p.name for p in (tmp_path / "model-7b").iterdir()) == before
    assert not (tmp_path / "run").exists()


def test_trainer_without_checkpointing_beside_a_sleeping_engine_is_refused_with_checkpointing_offered(tmp_path):
    from coordination.config import ConfigError
    from train.memory_plan import check_memory

    cfg = _cfg(_model(tmp_path), "train.ac.freq=0")
    with pytest.raises(ConfigError) as exc:
        check_memory(cfg, "both", 1)
    msg = str(exc.value)
    assert "trainer (200.9 GiB peak per GPU)" in msg and "(2.0 GiB asleep)" in msg
    assert "train.ac.freq=1 train.ac.mode=full (trainer 32.4 + engine 2.0 GiB)" in msg
    assert "between_iterations=restart" not in msg  # the trainer alone does not fit either
    assert check_memory(cfg, "update", 1) is None     # pipelined: the engine runs on other nodes


def test_gpu_visible_needs_device_files_and_a_non_empty_cuda_visible_devices(monkeypatch):
    from train.memory_plan import gpu_visible

    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: str(p) == "/dev/nvidiactl" or real_exists(p))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpu_visible()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert gpu_visible()
    monkeypatch.setattr(Path, "exists", lambda p: str(p) not in ("/dev/nvidiactl", "/dev/kfd") and real_exists(p))
    assert not gpu_visible()
