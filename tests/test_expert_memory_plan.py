"""The memory plan's expert-parallel terms (train/trainer_memory.py) against docs/design.md §10.5's
third worked example (a Qwen3-30B-A3B-shaped MoE on 8 x 80 GiB, ep=8), within 15% as the other
worked examples; the expert bytes per rank, exactly; and the mesh the dry run prints."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

from coordination.config import ConfigError
from tests.test_memory_plan import _both, _cfg, _model
from tests.test_run_cli import RUN, env
from train.config import TrainConfig
from train.memory_check import check_memory
from train.model_shape import GIB, ModelShape
from train.trainer_memory import trainer_memory

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "tie_word_embeddings": False}
# docs/design.md §10.5's third example by hand (GiB = 2^30 B): configs/gpu-example.yaml on 1 node
# of 8, ep=8, vLLM tensor_parallel_size=2; h 2048, q 4096, kv 512, I_e 768, top-8 of E=128, L=48, V=151936.
#   block = attention 18,874,368 + experts X_l = 128 x 3 x 2048 x 768 = 603,979,776 + router
#   262,144 + norms 4,096 = 623,120,384; root 2Vh + h = 622,331,904; P = 30,532,110,336;
#   experts X = 48 X_l = 28,991,029,248; per rank (P - X)/8 + X/8 = P/8
#   held: params 4P/8 = 14.218, gathered 2 x (root + 2 (block - X_l)) = 1.230, 2-byte copies of
#   the rank's experts of 2 blocks 2 x 2 X_l/8 = 0.281, grads 14.218, AdamW 28.436,
#   kept (48 x 2 x 2048 + 8 x 2048) x 32768 = 6.500, fixed 3
#   head: chunks (128) 0.218, weight gradient 6Vh = 1.739
#   block: A = 12h + 2(2h + 2q + 2kv + 2kh + 4k I_e) + 4 x 32 = 166,016 B x 32768 = 5.066;
#   unsharded gradient 10 (block - X_l + X_l/8) = 0.881; head's bf16 gradient 2Vh = 0.580;
#   all-to-all 4 x 32768 x 8 x 2048 x 2 B = 4.000 -> 10.527
#   peak 67.884 + 10.527 = 78.41; step 74.09; + 2 asleep = 80.41 > 80: refused
#   ep=1: gathered 2 x (root + 2 block) = 3.480, unsharded 10 block = 5.803 -> peak 81.30
#   optim_cpu_offload at ep=8: forward/backward 49.97, step 74.09, + 2 = 76.09: fits
WORKED_30B = {"parameters": 14.218, "gathered": 1.230, "2-byte copies": 0.281, "gradients": 14.218,
              "AdamW": 28.436, "activations kept": 6.500, "LM head: chunks": 0.218, "LM head weight": 1.739,
              "activations of the block": 5.066, "its unsharded": 0.881, "LM head's": 0.580, "all-to-all": 4.000,
              "peak": 78.41, "step": 74.09, "training": 80.41}
EP8 = ["train.ep=8", "inference.vllm.tensor_parallel_size=2", "inference.vllm.data_parallel_size=4"]


def _terms(plan) -> dict[str, float]:
    t = plan.trainer
    terms = {key: b / GIB for key in WORKED_30B for name, b in t.rows + t.head + t.block if name.startswith(key)}
    terms.update(peak=t.peak / GIB, step=t.step_peak / GIB, training=plan.training_total / GIB)
    return terms


def test_plan_of_a_30b_a3b_moe_at_ep8_on_8_gpus_matches_the_worked_example(tmp_path):
    model = _model(tmp_path, QWEN3_30B_A3B, "model-30b-a3b")
    plan = _both(_cfg(model, *EP8), 1)
    assert plan.shape.params == 30_532_110_336 and plan.shape.all_expert_params == 28_991_029_248
    got = _terms(plan)
    for key, want in WORKED_30B.items():
        assert got[key] == pytest.approx(want, rel=0.15), key
    assert not plan.fits
    ep1 = _both(_cfg(model, *EP8[1:]), 1)
    assert ep1.trainer.peak / GIB == pytest.approx(81.30, rel=0.15)
    assert ep1.trainer.peak - plan.trainer.peak == pytest.approx((81.30 - 78.41) * GIB, rel=0.01)
    offloaded = _both(_cfg(model, *EP8, "train.optim_cpu_offload=true"), 1)
    assert offloaded.trainer.forward_backward / GIB == pytest.approx(49.97, rel=0.15)
    assert offloaded.training_total / GIB == pytest.approx(76.09, rel=0.15) and offloaded.fits
    with pytest.raises(ConfigError) as exc:
        check_memory(_cfg(model, *EP8), serves=True, trains=True, num_nodes=1)
    msg = str(exc.value)
    assert "the trainer (78.4 GiB peak per GPU)" in msg and "train.optim_cpu_offload=true" in msg
    assert "train.fsdp_cpu_offload=true" not in msg            # does not combine with ep


def test_each_rank_holds_the_experts_divided_by_ep_and_the_rest_divided_by_dp_shard():
    shape = ModelShape.from_dict(QWEN3_30B_A3B)
    x, p = shape.all_expert_params, shape.params
    train = replace(TrainConfig(), dtype="bfloat16", nproc_per_node=8)
    for world, ep in ((16, 8), (16, 4), (8, 2)):
        rows = dict(trainer_memory(shape, replace(train, ep=ep), world).rows)
        master = next(b for name, b in rows.items() if name.startswith("parameters"))
        assert master == pytest.approx(4 * ((p - x) / world + x / ep))
    # Two nodes at ep=8: each rank keeps twice the expert bytes FSDP2 over 16 would, and gathers none.
    fsdp16 = dict(trainer_memory(shape, train, 16).rows)
    ep8 = dict(trainer_memory(shape, replace(train, ep=8), 16).rows)
    assert next(b for n, b in ep8.items() if n.startswith("parameters")) > \
        next(b for n, b in fsdp16.items() if n.startswith("parameters"))
    assert next(b for n, b in ep8.items() if n.startswith("gathered")) < \
        next(b for n, b in fsdp16.items() if n.startswith("gathered"))


def test_dry_run_prints_the_trainer_mesh_with_ep_and_cp(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4}))
    res = subprocess.run([RUN, "--data-path", str(tmp_path), "--log-path", str(tmp_path / "l"), "--rl-phase", "update",
                          "--num-nodes", "2", "--rank-weights", "1,1", "--master", "--dry-run", f"model.path={model}",
                          "train.ep=2", "train.nproc_per_node=2"],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert ("trainer mesh: 4 process(es); FSDP2 dp_replicate=1 x dp_shard=4; experts: ep_replicate=2 x ep=2 "
            "(each rank keeps 1/2 of every layer's experts, whole); cp=1") in res.stdout, res.stdout + res.stderr
