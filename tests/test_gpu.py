"""The gpu tier: what only a CUDA GPU can show (scripts/test.sh --gpu; skipped without CUDA).

The CPU tests prove the logic of each path on gloo; these run the same code where it meets NCCL,
bfloat16, vLLM's CUDA server and the caching allocator:
- an FSDP2 training step over NCCL in bfloat16 (one process per GPU, at most 2), the sharded load
  before it and the parallel publication after it: the published bf16 weights are exactly the
  trained ones cast; the same for the tiny mixture-of-experts model (router and experts on CUDA,
  the per-expert publication layout);
- vLLM on the GPU serves that publication, frees its memory asleep, wakes with other weights and
  reloads: each time its logprobs match a transformers forward of the weights it should serve;
- the memory plan (train/memory_plan.py) against the peak the caching allocator measures in a
  training step of the ~200M model.

Tolerances: vLLM on a GPU computes in bfloat16 (it runs float32 checkpoints in a 16-bit type);
bf16 keeps 8 bits of mantissa, so a logit of magnitude ~1 is off by up to ~4e-3 and a log-softmax
over 100 tokens by a few times that: 0.05 leaves a margin of ~10x while a wrong weight moves
logprobs by whole units. The memory plan is an estimate meant to refuse what cannot fit: the
allocator's measured peak must not exceed the plan (less its fixed overhead, which the allocator
does not see) by more than 10 %, nor be below half of it (a plan that far above reality would
refuse runs that fit).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests import train_support as ts
from tests.test_train_sharded_io import _launch, _load, _published_weights
from tests.test_vllm_real import PROMPTS, _encode, reference  # noqa: F401  (reference: a fixture)

pytestmark = pytest.mark.gpu

LOGPROB_TOL = 0.05


def _world() -> int:
    return max(1, min(2, torch.cuda.device_count()))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ts.make_tiny(tmp_path_factory.mktemp("gpu-base") / "tiny", layers=2)


@pytest.fixture(scope="module")
def published(base, tmp_path_factory) -> Path:
    """One bf16 FSDP2 step over NCCL on the GPUs, then the parallel publication (OUT/ckpt)."""
    out = tmp_path_factory.mktemp("gpu-publish")
    _launch("publish", base, out, _world(), extra={"dtype": "bfloat16"}, timeout=600)
    return out


def test_fsdp2_nccl_bf16_step_publishes_exactly_what_it_trained(base, published):
    from coordination.checkpoints import is_complete
    from coordination.records import read_record

    ckpt = published / "ckpt"
    assert is_complete(ckpt, run_id="run-t")
    assert read_record(ckpt / "trainer_state.json").data["weights_dtype"] == "bfloat16"
    step = json.loads((published / "step.json").read_text())
    assert step["peak_memory_mb"] > 0 and step["grad_norm"] > 0   # measured on the GPU by the allocator
    trained = _load(published / "trained.safetensors")
    weights, dtype = _published_weights(ckpt)
    assert dtype == torch.bfloat16
    for k, v in trained.items():
        assert torch.equal(weights[k], v.to(torch.bfloat16)), k
    assert not torch.equal(trained["model.norm.weight"], _load(base / "model.safetensors")["model.norm.weight"])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_moe_bf16_step_on_the_gpu_publishes_exactly_what_it_trained(tmp_path, family):
    """The tiny MoE (4 experts, top-2, the load-balancing loss on) through the same step and
    publication in bfloat16 on CUDA: the router's top-k, its auxiliary loss and the experts' matmuls
    run on the GPU, and the per-expert Hugging Face layout the publication writes loads back to
    exactly the trained weights cast."""
    moe = ts.make_tiny(tmp_path / "tiny-moe", layers=2, experts=4, top_k=2, family=family,
                       router_aux_loss_coef=0.01)
    out = tmp_path / "publish"
    _launch("publish", moe, out, _world(), extra={"dtype": "bfloat16"}, timeout=600)
    step = json.loads((out / "step.json").read_text())
    assert step["aux_loss"] > 0, step   # the router's balance term was computed and counted
    trained = _load(out / "trained.safetensors")
    weights, dtype = _published_weights(out / "ckpt")
    assert dtype == torch.bfloat16
    assert any(".experts." in k for k in trained)
    assert trained.keys() <= weights.keys()   # lm_head.weight: tied to the embedding, saved once
    for k, v in trained.items():
        assert torch.equal(weights[k], v.to(torch.bfloat16)), k
    start, _ = _published_weights(moe)
    assert [k for k in trained if ".experts." in k and not torch.equal(trained[k], start[k])], \
        "the step moved no expert weight"


def _engine(tmp_path: Path):
    from rollout.engines import make_engine
    from rollout.inference import InferenceConfig, VLLMConfig

    cfg = InferenceConfig(engine="vllm", between_iterations="sleep",
                          vllm=VLLMConfig(python=sys.executable, cpu=False, gpu_memory_utilization=0.3,
                                          enforce_eager=True, startup_timeout=900.0))
    return make_engine(cfg, rank=0, restart_count=0, temperature=1.0, log_file=tmp_path / "server.log")


def _check(engine, tokenizer, reference, model_dir: Path) -> None:  # noqa: F811
    from rollout.engine import Sampling

    prompts = [_encode(tokenizer, t) for t in PROMPTS]
    worst = 0.0
    for prompt, group in zip(prompts, engine.generate(prompts, 2, Sampling(max_new_tokens=12, temperature=1.0,
                                                                            seed=3))):
        for s in group:
            expected, _ = reference(model_dir, prompt, s.token_ids, 1.0)
            worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, expected)))
    assert worst < LOGPROB_TOL, f"{model_dir}: largest logprob difference to the transformers forward {worst}"


def test_vllm_serves_the_publication_and_sleeps_wakes_and_reloads_on_the_gpu(base, published, reference,  # noqa: F811
                                                                            tmp_path):
    from transformers import AutoTokenizer

    ckpt = published / "ckpt"
    tokenizer = AutoTokenizer.from_pretrained(base)
    engine = _engine(tmp_path)
    try:
        engine.start(ckpt)
        pgid = engine.server.pgid
        _check(engine, tokenizer, reference, ckpt)
        free_awake, total = torch.cuda.mem_get_info(0)
        engine.sleep()
        free_asleep, _ = torch.cuda.mem_get_info(0)
        freed = free_asleep - free_awake
        print(f"vLLM asleep freed {freed / 2**30:.2f} GiB of {0.3 * total / 2**30:.2f} GiB it was given")
        assert freed >= 0.5 * 0.3 * total, (free_awake, free_asleep, total)
        engine.wake(base)
        assert engine.server.pgid == pgid and engine.model_dir == base.resolve()
        _check(engine, tokenizer, reference, base)
        engine.reload(ckpt)
        assert engine.server.pgid == pgid
        _check(engine, tokenizer, reference, ckpt)
    finally:
        engine.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


@pytest.fixture(scope="module")
def model_200m(tmp_path_factory) -> Path:
    from bench.load_publish import bench_model

    return bench_model(tmp_path_factory.mktemp("gpu-m200") / "model")


def test_the_memory_plan_bounds_the_peak_of_a_training_step_of_a_200m_model(model_200m, tmp_path):
    from tests.test_train_sharded_io import _config
    from tests.test_train_levers_dist import _rows
    from train.model_shape import GIB, ModelShape
    from train.trainer_memory import TRAINER_OVERHEAD_GIB, trainer_memory

    shape = ModelShape.from_model_dir(model_200m)
    tokens = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in _rows(shape.vocab))
    extra = {"dtype": "bfloat16", "micro_batch_tokens": tokens}
    world = _world()
    _launch("publish", model_200m, tmp_path, world, extra=extra, timeout=900)
    measured = json.loads((tmp_path / "step.json").read_text())["local_peak_memory_mb"] * 2**20
    # The allocator's peak counts tensors, not the CUDA context, NCCL or fragmentation: compare it
    # with the plan less its fixed overhead.
    plan = trainer_memory(shape, _config(extra), world, on_gpu=True).peak - TRAINER_OVERHEAD_GIB * GIB
    print(f"training step of {shape.params / 1e6:.0f}M parameters on {world} GPU(s): measured peak "
          f"{measured / 2**30:.2f} GiB, planned {plan / 2**30:.2f} GiB (fixed overhead left out)")
    assert 0.5 * plan <= measured <= 1.1 * plan, (measured, plan)
