"""The GPU memory plan (train/memory_plan.py, docs/design.md §10.5): the two worked examples (7B on
2 x 8 x 80 GiB, 70B on 4 x 8 x 80 GiB with FSDP's CPU offload), the levers moving the estimate the
right way, both phases where the engine and the trainer share a GPU, and scripts/run.sh refusing
a run that cannot share them, before anything is written and without loading weights."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from coordination.config import ConfigError
from rl.runconfig import load_run_config
from tests.procs import ROOT, env
from train.checkpoint_size import checkpoint_size
from train.memory_check import check_memory
from train.memory_plan import MemoryPlan, make_plan
from train.model_shape import GIB, ModelShape
from train.trainer_memory import trainer_memory

GPU_EXAMPLE = ROOT / "configs" / "gpu-example.yaml"
# The sizes the plan reads from config.json, and no weights.
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}
LLAMA_70B = {**LLAMA_7B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256}

# docs/design.md §10.5's first example by hand (GiB = 2^30 B): configs/gpu-example.yaml on 2 nodes,
# FSDP2 over 16, bf16 compute, every block checkpointed, 32768 tokens, LM head chunks of 512 tokens.
#   block = 4 x 4096^2 + 3 x 4096 x 11008 + 2 x 4096 = 202,383,360; V h = 131,072,000
#   P = 32 x block + 2 V h + 4096 = 6,738,415,616
#   held: params 4P/16 = 1.569, gathered 2 x (2 V h + 4096 + 2 block) = 1.242, grads 4P/16 = 1.569,
#   AdamW 8P/16 = 3.138, kept activations (32 x 2 x 4096 + 8 x 4096) x 32768 = 9.000, fixed 3
#   head's backward: chunks 3 x 4 x 512 x 32000 + 8 x 32768 = 0.183, weight gradient 6 V h = 0.732
#   block recomputed: (20h + 4kv + 8i + 4 x 32) x 32768 = 186,496 x 32768 = 5.692,
#   unsharded gradient 10 block = 1.885, head's bf16 gradient 2 V h = 0.244 -> 7.821 (the larger)
#   peak 19.518 + 7.821 = 27.34; + 2 asleep = 29.34; rolling out 0.85 x 80 + 1.5 = 69.50
#   vLLM weights 2P = 12.551, KV cache 68 - 12.551 - 2 = 53.449
#   disk: weights 2P = 12.551, ::master 4P = 25.103, moments 8P = 50.205
WORKED_7B = {"parameters": 1.569, "gathered": 1.242, "gradients": 1.569, "AdamW": 3.138, "activations kept": 9.000,
             "LM head: chunks": 0.183, "LM head weight": 0.732, "activations of the block": 5.692,
             "its unsharded": 1.885, "LM head's": 0.244, "peak": 27.34, "training": 29.34, "rolling out": 69.50,
             "weights": 12.551, "kv_cache": 53.449, "disk weights": 12.551, "disk master": 25.103,
             "disk moments": 50.205}
# The second: the same file on 4 nodes with train.fsdp_cpu_offload=true (what the plan used to
# suggest for 70B) and vLLM over tensor_parallel_size=8.
#   block = 855,654,400; V h = 1,050,673,152; P = 80 x block + 2 V h + 8192 = 70,553,706,496
#   held: shards, moments on the host; gathered 2 x (2 V h + 8192 + 2 block) = 7.102;
#   kept (80 x 2 x 8192 + 8 x 8192) x 32768 = 42.000; fixed 3
#   head's backward: chunks (auto: 128 tokens) 0.184, weight gradient 6 V h = 5.871
#   block recomputed: 397,568 x 32768 = 12.133, unsharded gradient 10 block = 7.969, bf16 head 1.957
#   peak 52.102 + 22.059 = 74.16 (the old plan: 67.6), + 2 asleep = 76.16: fits.
#   kl_coef > 0 adds the reference's root, 2 x (2 V h + 8192) = 3.914: 80.07 > 80, refused.
#   vLLM weights 2P/8 = 16.427, KV cache 68 - 16.427 - 2 = 49.573
WORKED_70B = {"gathered": 7.102, "activations kept": 42.000, "LM head: chunks": 0.184, "LM head weight": 5.871,
              "activations of the block": 12.133, "its unsharded": 7.969, "LM head's": 1.957, "peak": 74.16,
              "training": 76.16, "rolling out": 69.50, "weights": 16.427, "kv_cache": 49.573,
              "disk weights": 131.42, "disk master": 262.83, "disk moments": 525.67}
OFFLOADED_70B = ["train.fsdp_cpu_offload=true", "inference.vllm.tensor_parallel_size=8",
                 "inference.vllm.data_parallel_size=1"]


def _model(tmp_path: Path, config: dict = LLAMA_7B, name: str = "model-7b") -> Path:
    """The model's config.json and a tokenizer (the dry run measures prompts with it), no weights."""
    from train.tiny import build_tokenizer

    model = tmp_path / name
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    if not (model / "tokenizer.json").exists():
        build_tokenizer().save_pretrained(model)
    return model


def _cfg(model: Path, *overrides: str):
    return load_run_config([GPU_EXAMPLE], [f"model.path={model}", "train.gpu_memory_gib=80", *overrides])


def _both(cfg, nodes: int) -> MemoryPlan:
    return make_plan(cfg, serves=True, trains=True, num_nodes=nodes)


def _terms(plan: MemoryPlan) -> dict[str, float]:
    """The plan's numbers in GiB under WORKED_*'s names (a row by the start of its name)."""
    t = plan.trainer
    rows = t.rows + t.head + t.block
    terms = {key: b / GIB for key in WORKED_7B for name, b in rows if name.startswith(key)}
    terms.update(peak=t.peak / GIB, training=plan.training_total / GIB, weights=plan.engine.weights / GIB,
                 kv_cache=plan.engine.kv_cache / GIB, **{"rolling out": plan.rollout_total / GIB})
    terms.update({"disk weights": plan.disk.weights / GIB, "disk master": plan.disk.master / GIB,
                  "disk moments": plan.disk.moments / GIB})
    return terms


def test_plan_of_a_7b_model_on_2_nodes_of_8_gpus_of_80_gib_matches_the_worked_example(tmp_path):
    plan = _both(_cfg(_model(tmp_path)), 2)
    assert plan.shape.params == 6_738_415_616 and plan.world_size == 16
    got = _terms(plan)
    for key, want in WORKED_7B.items():
        assert got[key] == pytest.approx(want, rel=0.15), key
    assert plan.shared and plan.fits  # gpu-example.yaml sleeps the engine and offloads the trainer


def test_plan_of_a_70b_model_on_4_nodes_with_fsdp_cpu_offload_matches_the_worked_example(tmp_path):
    model = _model(tmp_path, LLAMA_70B, "model-70b")
    plan = _both(_cfg(model, *OFFLOADED_70B), 4)
    assert plan.shape.params == 70_553_706_496 and plan.world_size == 32
    got = _terms(plan)
    for key, want in WORKED_70B.items():
        assert got[key] == pytest.approx(want, rel=0.15), key
    assert got["parameters"] == got["gradients"] == got["AdamW"] == 0.0  # all on the host
    assert plan.fits
    with_kl = _both(_cfg(model, *OFFLOADED_70B, "train.kl_coef=0.001"), 4)
    assert (with_kl.trainer.peak - plan.trainer.peak) / GIB == pytest.approx(2 * (2 * 1_050_673_152 + 8192) / GIB)
    with pytest.raises(ConfigError) as exc:
        check_memory(_cfg(model, *OFFLOADED_70B, "train.kl_coef=0.001"), serves=True, trains=True, num_nodes=4)
    msg = str(exc.value)
    assert "the trainer (78.1 GiB peak per GPU)" in msg and "need 80.1 GiB of the 80.0 GiB per GPU" in msg
    assert "train.micro_batch_tokens=16384" in msg and "train.ac_offloading.enabled=true" in msg


def test_levers_move_the_trainer_estimate_the_way_they_move_memory():
    shape = ModelShape.from_dict(LLAMA_7B)
    base = load_run_config([GPU_EXAMPLE], []).train

    def peak(**change) -> float:
        return trainer_memory(shape, replace(base, **change), 8).peak

    no_ac = peak(ac=replace(base.ac, freq=0))
    assert no_ac > 5 * peak()                                         # 32k tokens without AC: ~168 GiB more
    assert peak(ac=replace(base.ac, freq=2)) < no_ac                  # every other block
    assert peak(micro_batch_tokens=8192) < peak()
    assert peak(fsdp_cpu_offload=True) < peak(optim_cpu_offload=True) < peak()
    assert peak(dp_replicate=2) > peak()                              # shards over 4 instead of 8
    assert peak(lora=replace(base.lora, rank=16)) < peak()            # no full gradients or AdamW state
    assert peak(kl_coef=0.1) > peak()                                 # the reference's shard and root
    assert peak(fused_lm_head_token_chunk_size="disabled") > peak() + 5 * GIB  # [32768, 32000] logits
    ddp = peak(backend="ddp")
    assert ddp > 6.7e9 * 20 - 1                                       # replicated: 4+2+8+8 B per parameter


def test_engine_kept_while_training_follows_between_iterations(tmp_path):
    model = _model(tmp_path)
    during = {mode: _both(_cfg(model, f"inference.between_iterations={mode}"), 2).training_total / GIB
              for mode in ("reload", "sleep", "restart")}
    trainer = make_plan(_cfg(model), serves=False, trains=True, num_nodes=2)  # an update job
    assert trainer.engine is None and not trainer.shared and trainer.rollout_total == 0
    alone = trainer.trainer.peak / GIB
    assert during == {"restart": pytest.approx(alone), "sleep": pytest.approx(alone + 2.0),
                      "reload": pytest.approx(alone + 0.85 * 80)}


def test_what_the_trainer_keeps_while_rolling_out_follows_resident_and_offload(tmp_path):
    model = _model(tmp_path)
    offloaded = _both(_cfg(model), 2)
    kept = _both(_cfg(model, "train.offload_between_iterations=false"), 2)
    ended = _both(_cfg(model, "train.offload_between_iterations=false", "train.resident=false"), 2)
    assert offloaded.residue[1] == 1.5 * GIB and offloaded.rollout_total == 0.85 * 80 * GIB + 1.5 * GIB
    assert kept.residue[1] == kept.trainer.peak and not kept.fits  # 68 + 27.3 GiB > 80
    assert kept.training_total == offloaded.training_total         # the training phase is the same
    assert ended.residue[1] == 0 and ended.fits
    accepted = check_memory(_cfg(model, "train.offload_between_iterations=false", "train.resident=false"),
                            serves=True, trains=True, num_nodes=2)
    assert accepted.rollout_total == 0.85 * 80 * GIB


def _dry_run(tmp_path: Path, *overrides: str, gpu: bool = True) -> subprocess.CompletedProcess:
    from rollout.tasks import arithmetic_tasks, write_tasks

    data = tmp_path / "data"
    if not data.exists():
        data.mkdir()
        train, ev = arithmetic_tasks(512, 10, digits=2, seed=3)  # the GPU example's tasks_per_iteration
        write_tasks(data / "train.jsonl", train)
        write_tasks(data / "eval.jsonl", ev)
    cmd = [str(ROOT / "scripts/run.sh"), "--data-path", str(data), "--log-path", str(tmp_path / "run"),
           "--rl-phase", "both", "--eval-interval", "0", "--num-nodes", "2", "--rank-weights", "1,1", "--master",
           "--dry-run", "--config", str(GPU_EXAMPLE), f"model.path={_model(tmp_path)}",
           *(["train.gpu_memory_gib=80"] if gpu else []), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def test_a_trainer_that_keeps_its_state_beside_the_engine_is_refused_with_its_numbers(tmp_path):
    res = _dry_run(tmp_path, "train.offload_between_iterations=false")
    assert res.returncode == 2, res.stdout + res.stderr
    err = " ".join(res.stderr.split())
    assert "while rolling out, the vLLM server (68.0 GiB = gpu_memory_utilization 0.85 x 80.0 GiB" in err
    assert "the trainer (27.3 GiB: its peak, kept reserved by train.offload_between_iterations=false)" in err
    assert "need 95.3 GiB of the 80.0 GiB per GPU" in err
    assert "train.offload_between_iterations=true (engine 68.0 + trainer 1.5 GiB" in err
    assert "train.resident=false" in err and "inference.vllm.gpu_memory_utilization=0.65" in err
    assert "during training" not in err  # the training phase itself fits beside the sleeping engine
    assert not (tmp_path / "run").exists()


def test_reload_beside_the_trainer_is_refused_with_its_numbers_and_the_settings_that_fit(tmp_path):
    res = _dry_run(tmp_path, "inference.between_iterations=reload", "inference.vllm.gpu_memory_utilization=0.9")
    assert res.returncode == 2, res.stdout + res.stderr
    err = " ".join(res.stderr.split())
    assert "trainer (27.3 GiB peak per GPU)" in err and "(72.0 GiB = gpu_memory_utilization 0.9 x 80.0 GiB)" in err
    assert "need 99.3 GiB of the 80.0 GiB per GPU" in err
    assert "inference.between_iterations=sleep (trainer 27.3 + asleep engine 2.0 GiB)" in err
    assert "inference.vllm.gpu_memory_utilization=0.65" in err
    assert "train.fsdp_cpu_offload" not in err  # not enough beside a 72 GiB server: not offered
    assert "while rolling out" not in err       # 72 + 1.5 GiB fit
    assert not (tmp_path / "run").exists()


def _table(text: str) -> dict[str, str]:
    """A printed table's rows: name -> the number at its end."""
    return {line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1] for line in text.splitlines() if line.strip()}


def test_gpu_example_passes_and_dry_run_prints_both_phases_and_the_disk_use_without_weights(tmp_path):
    before = sorted(p.name for p in _model(tmp_path).iterdir())
    assert "config.json" in before and not any(name.endswith(".safetensors") for name in before)
    res = _dry_run(tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    plan = res.stdout.split("## memory plan per GPU", 1)[1]
    assert "6.74B parameters" in plan and "between_iterations=sleep (level 2)" in plan
    lines = _table(plan)
    assert lines["while training (trainer + engine) of 80.0 GiB: fits"] == "29.34"
    assert lines["while rolling out (engine + trainer) of 80.0 GiB: fits"] == "69.50"
    assert lines["one checkpoint on disk"] == "87.86" and lines["fp32 state: <param>::master in optimizer/"] == "25.10"
    assert max(len(line) for line in plan.splitlines()) <= 100
    assert "## checkpoint disk use" not in res.stdout  # the plan showed it
    assert sorted(p.name for p in (tmp_path / "model-7b").iterdir()) == before
    assert not (tmp_path / "run").exists()


def test_dry_run_without_a_gpu_plan_prints_the_checkpoint_disk_use_in_float32(tmp_path):
    res = _dry_run(tmp_path, "inference.engine=transformers", "train.dtype=auto", gpu=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "## memory plan per GPU" not in res.stdout
    disk = _table(res.stdout.split("## checkpoint disk use", 1)[1])
    # float32 on a node without a GPU: weights 4P, ::master 4P, moments 8P of P = 6,738,415,616
    assert disk["weights (float32)"] == disk["fp32 state: <param>::master in optimizer/"] == "25.10"
    assert disk["one checkpoint on disk"] == "100.41"


def test_trainer_without_checkpointing_beside_a_sleeping_engine_is_refused_with_checkpointing_offered(tmp_path):
    cfg = _cfg(_model(tmp_path), "train.ac.freq=0")
    with pytest.raises(ConfigError) as exc:
        check_memory(cfg, serves=True, trains=True, num_nodes=2)
    msg = str(exc.value)
    assert "(2.0 GiB asleep)" in msg and "train.ac.freq=1 train.ac.mode=full (trainer 27.3 + engine 2.0 GiB)" in msg
    assert "between_iterations=restart" not in msg  # the trainer alone does not fit either
    assert check_memory(cfg, serves=False, trains=True, num_nodes=2) is None  # pipelined: the engine is elsewhere


def test_checkpoint_size_counts_the_fp32_state_and_the_moments_of_what_trains():
    shape = ModelShape.from_dict(LLAMA_7B)
    base = load_run_config([GPU_EXAMPLE], []).train
    full = checkpoint_size(shape, base, on_gpu=True)
    assert (full.weights, full.adapters, full.master, full.moments) == (2 * shape.params, 0, 4 * shape.params,
                                                                        8 * shape.params)
    assert checkpoint_size(shape, replace(base, dtype="auto"), on_gpu=False).weights == 4 * shape.params
    lora = replace(base.lora, rank=16)
    n = shape.lora_params(16, lora.target_modules)
    merged = checkpoint_size(shape, replace(base, lora=lora), on_gpu=True)
    adapters = checkpoint_size(shape, replace(base, lora=replace(lora, publish="adapters")), on_gpu=True)
    assert (merged.weights, merged.adapters, merged.master, merged.moments) == (2 * shape.params, 4 * n, 4 * n, 8 * n)
    assert adapters.weights == 0 and adapters.total == 16 * n


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
