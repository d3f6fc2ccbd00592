"""Each memory/speed lever against the plain trainer, in this process (a process group of one).

Tolerances: float32 throughout; a lever that only reorders or recomputes the same float32
arithmetic must give the plain loss and gradients within the float32 rounding of that
arithmetic, derived in tests/tolerance.py from the magnitudes of the summed terms and the length
of the reduction chain (about 4e-4 on the loss, whose per-token terms add up to ~52 in absolute
value, and 1.4e-5 on gradients of at most 0.18 for this 3-layer model and 52 tokens). A fixed
1e-6 on the loss failed on CPUs whose kernels sum in another order (4e-6 seen on an AVX-512 EPYC);
`test_tolerances_cover_the_float32_rounding_of_the_plain_path` checks the derived ones against
the exact (float64) evaluation of the same arithmetic. Memory is measured (train/memory.py),
never assumed.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests import train_support as ts
from tests.tolerance import gradient_tolerance, loss_tolerance
from coordination.config import ConfigError, from_dict
from train.config import TrainConfig



@pytest.fixture(scope="module")
def info(process_group):
    return process_group


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ts.make_tiny(tmp_path_factory.mktemp("base") / "tiny", layers=3)


def _batch(vocab: int, rows: int = 4, width: int = 24, seed: int = 0):
    """Rows of different lengths (padding), advantages +-1, sampling logprobs near the random
    model's own (about -log 100), so importance ratios stay inside the clip range and every
    completion token carries gradient."""
    from train.batches import collate

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        n = width - 3 * i
        ids = torch.randint(4, vocab, (n,), generator=g).tolist()
        out.append({"prompt_ids": [1] + ids[:n // 3], "completion_ids": ids[n // 3:],
                    "logprobs": (-4.7 + 0.2 * torch.rand(n - n // 3, generator=g)).tolist(), "advantage": (-1.0) ** i})
    return collate(out, pad_id=0)


def _cfg(**kw) -> TrainConfig:
    data = {"fused_lm_head_token_chunk_size": "disabled", "algorithm": "grpo"}
    data.update(kw)
    return from_dict(TrainConfig, data)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def forward_backward(base: Path, info, cfg: TrainConfig, temperature: float = 1.0, dtype=torch.float32):
    """Build as the trainer does, run one micro-batch forward+backward; (loss, {name: full grad},
    trainable, masked per-token loss terms)."""
    from train.build import load_model, make_trainable
    from train.loss import clipped_policy_loss, micro_batch_loss

    torch.manual_seed(0)
    t = make_trainable(load_model(cfg, base, None), cfg, info)
    t.policy.lm.to(dtype)
    mb = _batch(t.policy.lm.config.vocab_size)
    old, adv = mb.old_logprobs.to(dtype), mb.advantages.to(dtype)
    logp, entropy = t.model(mb.input_ids, mb.attention_mask, mb.targets, temperature)
    parts = micro_batch_loss(logp, entropy, mb.loss_mask, algorithm=cfg.algorithm, old_logp=old, advantages=adv)
    (parts.loss / mb.completion_tokens).backward()
    grads = {n: _full(p.grad) for n, p in t.policy.lm.named_parameters() if p.grad is not None}
    terms = (clipped_policy_loss(logp.detach(), old, adv, clip_low=0.2, clip_high=0.28)[0] * mb.loss_mask).detach()
    return float(parts.loss.detach()), grads, t, terms


@pytest.fixture(scope="module")
def plain(base, info):
    """The plain run and the float32 tolerances of its loss and gradients (tests/tolerance.py)."""
    loss, grads, t, terms = forward_backward(base, info, _cfg())
    config, tokens = t.policy.lm.config, int(terms.ne(0).sum())
    largest = max(g.abs().max().item() for g in grads.values())
    return loss, grads, loss_tolerance(config, terms, tokens), gradient_tolerance(config, largest, tokens)


def _assert_same(result, plain_result) -> None:
    loss, grads = result[0], result[1]
    _, plain_grads, loss_tol, grad_tol = plain_result
    assert loss == pytest.approx(plain_result[0], abs=loss_tol)
    assert grads.keys() == plain_grads.keys()
    worst = max((grads[k].to(plain_grads[k].dtype) - plain_grads[k]).abs().max().item() for k in grads)
    assert worst <= grad_tol, (worst, grad_tol)


def test_tolerances_cover_the_float32_rounding_of_the_plain_path(base, info, plain):
    """The float64 evaluation of the same arithmetic is the exact result up to ~1e-16; another
    CPU's float32 result lies within the float32 rounding of it, which the tolerances must
    cover. A fixed 1e-6 on the loss did not: this very comparison differs by ~2e-6 here."""
    exact = forward_backward(base, info, _cfg(), dtype=torch.float64)
    _assert_same(exact, plain)
    loss_tol, grad_tol = plain[2], plain[3]
    assert loss_tol < 1e-3 and grad_tol < 3e-5   # still far below what a wrong lever changes (1e-3 and more)


@pytest.mark.parametrize("levers", [
    {"ac": {"freq": 1}},
    {"ac": {"freq": 2, "mode": "selective"}},
    {"ac": {"freq": 1, "mode": "selective", "targets": ["matmul", "aten.mm.default"]}},
    {"ac_offloading": {"enabled": True}},
    {"ac": {"freq": 1}, "ac_offloading": {"enabled": True, "max_inflight_activations": 1}},
    {"fused_lm_head_token_chunk_size": 7},
    {"fused_lm_head_token_chunk_size": "auto"},
    {"reshard_after_forward": False},
    {"fsdp_cpu_offload": True},
    {"backend": "ddp", "ac": {"freq": 1}, "fused_lm_head_token_chunk_size": 5},
], ids=["ac-full", "ac-selective-every-2nd", "ac-selective-matmul", "ac-offloading", "ac+offloading-inflight-1",
        "chunked-7", "chunked-auto", "no-reshard", "fsdp-cpu-offload", "ddp-ac-chunked"])
def test_lever_gives_the_plain_loss_and_gradients(base, info, plain, levers):
    result = forward_backward(base, info, _cfg(**levers))
    _assert_same(result, plain)
    trainable = result[2]
    if levers.get("ac"):
        expected = math.ceil(3 / levers["ac"]["freq"])
        assert trainable.checkpointed_blocks == expected
    if levers.get("ac_offloading"):
        offload = trainable.activation_offload
        assert offload.tensors > 0 and offload.bytes > 0   # the saved activations really went through the hooks


def test_chunked_head_values_and_gradients_equal_the_plain_path_at_temperature():
    from train.chunked_head import chunked_logprobs_and_entropy
    from train.loss import token_logprobs_and_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(48, 997, bias=False)
    hidden = torch.randn(3, 41, 48, requires_grad=True)
    targets = torch.randint(0, 997, (3, 41))
    weights = torch.randn(3, 41)
    results = []
    for fn in (lambda: token_logprobs_and_entropy(hidden, head, targets, 0.7),
               lambda: chunked_logprobs_and_entropy(hidden, head, targets, 0.7, 16)):
        hidden.grad, head.weight.grad = None, None
        logp, entropy = fn()
        (logp * weights).sum().backward()
        results.append((logp.detach(), entropy, hidden.grad.clone(), head.weight.grad.clone()))
    for a, b in zip(*results):
        assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5
    assert not results[1][1].requires_grad   # entropy is a diagnostic: no gradient


def test_chunked_head_lowers_the_measured_peak_memory_of_the_loss_at_least_4x():
    """vocab 32,768 x 4,096 tokens: the plain path holds [4096, 32768] float32 logits (512 MiB) and
    several tensors like them; the chunked one a few 1,024-token chunks."""
    from train.chunked_head import chunked_logprobs_and_entropy, resolve_chunk_size
    from train.loss import token_logprobs_and_entropy
    from train.memory import peak_tensor_bytes

    vocab, tokens = 32768, 4096
    torch.manual_seed(0)
    head = torch.nn.Linear(32, vocab, bias=False)
    hidden = torch.randn(1, tokens, 32, requires_grad=True)
    targets = torch.randint(0, vocab, (1, tokens))
    chunk = resolve_chunk_size("auto", vocab)

    def plain():
        token_logprobs_and_entropy(hidden, head, targets, 1.0)[0].sum().backward()

    def chunked():
        chunked_logprobs_and_entropy(hidden, head, targets, 1.0, chunk)[0].sum().backward()

    _, plain_peak = peak_tensor_bytes(plain)
    hidden.grad, head.weight.grad = None, None
    _, chunked_peak = peak_tensor_bytes(chunked)
    assert plain_peak >= tokens * vocab * 4          # the logits were really materialised
    assert chunked_peak * 4 <= plain_peak, (plain_peak / 2**20, chunked_peak / 2**20)


def test_activation_checkpointing_lowers_measured_activation_memory(tmp_path):
    """8-layer Llama, 1,024-token sequences: peak tensor memory of forward+backward over the
    weights, for no checkpointing, every 2nd block and every block."""
    from train.act_checkpoint import apply_activation_checkpointing
    from train.memory import peak_tensor_bytes
    from train.model import Policy, decoder_blocks, load_causal_lm

    model_dir = ts.make_tiny(tmp_path / "deep", layers=8, max_positions=1024)
    ids = torch.randint(4, 90, (2, 1024))
    mask = torch.ones_like(ids)
    peaks = {}
    for freq in (0, 2, 1):
        lm = load_causal_lm(model_dir)
        apply_activation_checkpointing(decoder_blocks(lm), freq=freq, mode="full", targets=[])
        policy = Policy(lm, head_chunk=256)

        def step():
            logp, _ = policy(ids, mask, ids[:, 1:])
            logp.sum().backward()

        _, peaks[freq] = peak_tensor_bytes(step)
    assert peaks[1] < peaks[2] < peaks[0], peaks
    assert peaks[1] * 2 < peaks[0], peaks     # every block: well under half the activations


def test_lora_trains_only_the_adapters_and_its_first_gradient_is_the_plain_one_projected(base, info, plain):
    """At the start B = 0, so the model and its loss are the plain ones, and dL/dB = (alpha/r) G A^T
    where G is the plain gradient of the adapted weight; A gets no gradient (B = 0)."""
    cfg = _cfg(lora={"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "down_proj"]})
    loss, grads, t, _ = forward_backward(base, info, cfg)
    assert loss == pytest.approx(plain[0], abs=plain[2])
    names = {n for n, p in t.policy.lm.named_parameters() if p.requires_grad}
    assert names == set(grads) and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert len(names) == 2 * 2 * 3                      # (A, B) x 2 targets x 3 blocks
    optimized = {id(p) for group in t.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in t.params} and len(t.params) == len(names)
    params = {n: _full(p) for n, p in t.policy.lm.named_parameters()}
    for name in names:
        if ".lora_B." not in name:
            assert grads[name].abs().max().item() == 0.0
            continue
        layer = name.split(".lora_B.")[0]
        expected = 2.0 * plain[1][layer + ".weight"] @ params[layer + ".lora_A.default.weight"].t()
        assert (grads[name] - expected).abs().max().item() <= plain[3], name
    before = {n: v.clone() for n, v in params.items()}
    t.optimizer.step()
    after = {n: _full(p) for n, p in t.policy.lm.named_parameters()}
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed == {n for n in names if ".lora_B." in n}


def test_optimizer_state_offload_moves_the_state_each_step_and_updates_like_plain(base, info):
    from train.build import load_model, make_trainable
    from train.step import StepSettings, train_step

    finals = {}
    for offload in (False, True):
        cfg = _cfg(optim_cpu_offload=offload)
        torch.manual_seed(0)
        t = make_trainable(load_model(cfg, base, None), cfg, info)
        settings = StepSettings(algorithm="grpo", backend="fsdp", dtype=torch.float32)
        mb = _batch(t.policy.lm.config.vocab_size)
        seen = []
        for _ in range(3):
            train_step(t.model, t.params, t.optimizer, [mb], global_completion_tokens=mb.completion_tokens, lr=1e-3,
                       settings=settings, info=info)
            seen.append(next(iter(t.optimizer.state.values()))["exp_avg"])   # kept alive: addresses stay unique
        finals[offload] = {n: _full(p) for n, p in t.policy.lm.named_parameters()}
        addresses = {_local_ptr(x) for x in seen}
        if not offload:
            assert len(addresses) == 1      # plain AdamW updates its state in place
        else:
            # Each step takes the state to the device and back: a new host copy every time.
            assert len(addresses) == 3 and t.optimizer_offload.moves > 0
            assert all(v.device.type == "cpu" for s in t.optimizer.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.ndim)
    assert all(torch.allclose(finals[True][k], finals[False][k], atol=0, rtol=0) for k in finals[False])


def _local_ptr(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).data_ptr()


def test_config_refuses_lever_combinations_with_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="fsdp_cpu_offload and train.optim_cpu_offload are mutually exclusive.*"
                                          "Set one of them to false"):
        _cfg(fsdp_cpu_offload=True, optim_cpu_offload=True)
    with pytest.raises(ConfigError, match="FSDP2 options but train.backend=ddp"):
        _cfg(backend="ddp", dp_replicate=2)
    with pytest.raises(ConfigError, match=r"fused_lm_head_token_chunk_size must be auto, disabled or a positive"):
        _cfg(fused_lm_head_token_chunk_size=0)
    with pytest.raises(ConfigError, match=r"ac.targets \['softmax'\] are not operators"):
        _cfg(ac={"freq": 1, "mode": "selective", "targets": ["softmax"]})
    with pytest.raises(ConfigError, match="lora.rank must be 0"):
        _cfg(lora={"rank": -1})


def test_startup_checks_name_what_to_change(info):
    from train.act_checkpoint import resolve_targets
    from train.build import preflight
    from train.config import check_world_size

    with pytest.raises(ConfigError, match=r"dp_replicate=3 does not divide the number of trainer processes \(4 "
                                          r".*one of \[1, 2, 4\]"):
        check_world_size(3, 4)
    with pytest.raises(ConfigError, match=r"dp_replicate=2 does not divide.*\(1 "):
        preflight(_cfg(dp_replicate=2), info)
    with pytest.raises(ConfigError, match="'aten.no_such_op' is not an operator"):
        resolve_targets(["aten.no_such_op"])


def test_preparing_training_data_for_an_hsdp_shape_that_does_not_fit_fails_before_any_launch(tmp_path):
    from coordination.layout import RunLayout
    from train.data import prepare_training_data

    with pytest.raises(ConfigError, match=r"dp_replicate=2 does not divide the number of trainer processes \(3 "):
        prepare_training_data(RunLayout(tmp_path), 1, _cfg(dp_replicate=2), run_id="r", world_size=3,
                              temperature=1.0, input_checkpoint=tmp_path, input_iteration=0)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_flash_attn_is_refused_with_the_fix(info):
    from train.build import preflight

    with pytest.raises(ConfigError, match="flash_attention_2 needs the flash-attn package, which is not installed.*"
                                          "set train.attn=sdpa"):
        preflight(_cfg(attn="flash_attention_2"), info)


@pytest.mark.slow
@pytest.mark.parametrize("levers", [{"compile": {}}, {"compile": {}, "ac": {"freq": 1, "mode": "selective"}}],
                         ids=["compile", "compile+selective-ac"])
def test_compiled_blocks_give_the_plain_loss_and_gradients(base, info, plain, levers):
    """Inductor fuses and reorders float32 arithmetic: held to 1e-5 on loss and gradients."""
    from torch._dynamo.utils import counters

    counters.clear()
    loss, grads, t, _ = forward_backward(base, info, _cfg(**levers))
    assert counters["stats"]["unique_graphs"] >= 1          # dynamo really compiled something
    blocks = [m for m in t.policy.lm.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert len(blocks) == 3 and all(hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks)
    assert loss == pytest.approx(plain[0], abs=1e-5)
    worst = max((grads[k] - plain[1][k]).abs().max().item() for k in plain[1])
    assert grads.keys() == plain[1].keys() and worst <= 1e-5, worst
