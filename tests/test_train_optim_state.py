"""Optimizer state through DCP (train/optim_state.py) in one process: round trip from FSDP2 into a
plain model, and clear refusals of state that does not fit. Resharding across world sizes is
tested on real processes in tests/test_train_sharded_io.py."""
from __future__ import annotations

import pytest
import torch

from coordination.checkpoint_files import Stamp
from coordination.checkpoints import CheckpointError
from train.config import TrainConfig
from train.optim_state import load_optimizer_state, save_optimizer_state


def _trained(model_dir, process_group, backend: str):
    from train.batches import collate
    from train.model import Policy, load_causal_lm
    from train.optim import build_optimizer
    from train.parallel import apply_parallelism
    from train.step import StepSettings, train_step

    policy = Policy(load_causal_lm(model_dir))
    model = apply_parallelism(policy, backend, process_group, torch.float32)
    opt = build_optimizer(policy.parameters(), TrainConfig())
    mb = collate([{"prompt_ids": [1, 20, 21], "completion_ids": [22, 2]}], pad_id=0)
    train_step(model, list(policy.parameters()), opt, [mb], global_completion_tokens=2, lr=1e-3,
               settings=StepSettings(algorithm="sft", backend=backend, dtype=torch.float32), info=process_group)
    return policy, opt


def test_fsdp_optimizer_state_round_trips_into_a_plain_model(tmp_path, process_group):
    from train.model import Policy, load_causal_lm, named_master_params
    from train.optim import build_optimizer
    from train.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", layers=2)
    policy, opt = _trained(model_dir, process_group, "fsdp")
    assert save_optimizer_state(tmp_path / "ckpt", policy, opt, rank=0, stamp=Stamp("run-a", 1))
    assert not list((tmp_path / "ckpt").rglob("*.metadata"))   # DCP's pickled metadata is never written

    plain = Policy(load_causal_lm(model_dir))
    opt2 = build_optimizer(plain.parameters(), TrainConfig())
    n, master = load_optimizer_state(tmp_path / "ckpt", opt2, plain)
    assert n == len(named_master_params(plain)) and master
    for (name, p), (_, q) in zip(named_master_params(policy), named_master_params(plain)):
        assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), opt2.state[q]["exp_avg"]), name
        assert torch.equal(opt.state[p]["exp_avg_sq"].full_tensor(), opt2.state[q]["exp_avg_sq"]), name
        assert float(opt2.state[q]["step"]) == 1.0
        # the plain model was loaded with the start weights: it now holds the trained float32 values
        assert torch.equal(p.full_tensor(), q.detach()), name


def test_float32_state_below_bf16_resolution_survives_a_reload_from_bf16_weights(tmp_path, process_group):
    # What a GPU run does each time it loads a checkpoint: weights published in bf16, upcast. An
    # update smaller than half a bf16 step is rounded away by that; the shards' float32 state puts it back.
    from train.model import Policy, load_causal_lm, named_master_params
    from train.optim import build_optimizer
    from train.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", layers=2)
    policy, opt = _trained(model_dir, process_group, "ddp")
    with torch.no_grad():
        for _, p in named_master_params(policy):
            p.add_(torch.full_like(p, 1e-6) * p.abs().clamp(min=1e-3))  # far below half a bf16 step
    trained = {n: p.detach().clone() for n, p in named_master_params(policy)}
    save_optimizer_state(tmp_path / "ckpt", policy, opt, rank=0, stamp=Stamp("run-a", 1))
    plain = Policy(load_causal_lm(model_dir))
    with torch.no_grad():  # the published weights, as a bf16 checkpoint gives them back
        for n, p in named_master_params(plain):
            p.copy_(trained[n].to(torch.bfloat16).float())
    lost = sum(int((p != trained[n]).sum()) for n, p in named_master_params(plain))
    assert lost > 0, "the test's update did not fall below bf16 resolution"
    _, master = load_optimizer_state(tmp_path / "ckpt", build_optimizer(plain.parameters(), TrainConfig()), plain)
    assert master
    for n, p in named_master_params(plain):
        assert torch.equal(p.detach(), trained[n]), n


def test_state_of_another_model_or_an_old_format_is_refused_with_the_fix(tmp_path, process_group):
    from train.model import Policy, load_causal_lm
    from train.optim import build_optimizer
    from train.tiny import write_tiny_model

    small = write_tiny_model(tmp_path / "small", layers=2)
    bigger = write_tiny_model(tmp_path / "bigger", layers=3)
    policy, opt = _trained(small, process_group, "ddp")
    save_optimizer_state(tmp_path / "ckpt", policy, opt, rank=0, stamp=Stamp("run-a", 1))
    other = Policy(load_causal_lm(bigger))
    with pytest.raises(CheckpointError, match="remove .*optimizer"):
        load_optimizer_state(tmp_path / "ckpt", build_optimizer(other.parameters(), TrainConfig()), other)
    old = tmp_path / "old" / "optimizer"
    old.mkdir(parents=True)
    (old / "rank-0.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no optimizer state written by this version"):
        load_optimizer_state(tmp_path / "old", build_optimizer(other.parameters(), TrainConfig()), other)
