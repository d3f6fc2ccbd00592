"""Optimizer state saved as safetensors + JSON per rank, and loaded with resharding."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from coordination.records import publish_record
from coordination.checkpoints import CheckpointError
from train.config import TrainConfig
from train.optim_state import _read_rows, _saved_shards, load_optimizer_state, save_optimizer_shard, shard_paths


@pytest.fixture(scope="module")
def group():
    from train.distributed import init_distributed, shutdown

    info = init_distributed(60)
    yield info
    shutdown()


def _two_rank_save(folder, full: torch.Tensor, split: int) -> None:
    """What two FSDP ranks write for one parameter `w` sharded on dim 0 at row `split`."""
    for rank, (a, b) in enumerate([(0, split), (split, full.shape[0])]):
        data, meta = shard_paths(folder, rank)
        data.parent.mkdir(parents=True, exist_ok=True)
        save_file({"w::exp_avg": full[a:b].contiguous(), "w::exp_avg_sq": (full[a:b] ** 2).contiguous()}, str(data))
        publish_record(meta, "optimizer-shard", {"rank": rank, "world_size": 2, "backend": "fsdp", "params": {
            "w": {"shape": list(full.shape), "rows": [a, b], "tensors": ["exp_avg", "exp_avg_sq"],
                  "scalars": {"step": {"value": 7.0, "dtype": "float32"}}}}}, run_id="r", generation=0)


def test_rows_spanning_two_saved_shards_are_read_from_both(tmp_path):
    full = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    _two_rank_save(tmp_path, full, split=5)
    shards = _saved_shards(tmp_path, 2)
    got = _read_rows(shards, "w", "exp_avg", [10, 3], (3, 8), {})
    assert torch.equal(got, full[3:8])
    assert _read_rows(shards, "w", "exp_avg", [10, 3], (10, 10), {}).shape == (0, 3)


def test_state_saved_by_two_ranks_loads_whole_into_one_process(tmp_path):
    full = torch.randn(10, 3)
    _two_rank_save(tmp_path, full, split=5)
    w = torch.nn.Parameter(torch.zeros(10, 3))
    opt = torch.optim.AdamW([w])
    assert load_optimizer_state(tmp_path, opt, [("w", w)], saved_world_size=2) == 1
    assert torch.equal(opt.state[w]["exp_avg"], full)
    assert torch.equal(opt.state[w]["exp_avg_sq"], full ** 2)
    assert float(opt.state[w]["step"]) == 7.0


def test_state_of_another_shape_or_missing_shard_is_refused(tmp_path):
    _two_rank_save(tmp_path, torch.zeros(10, 3), split=5)
    w = torch.nn.Parameter(torch.zeros(12, 3))
    with pytest.raises(CheckpointError, match="belongs to another model"):
        load_optimizer_state(tmp_path, torch.optim.AdamW([w]), [("w", w)], saved_world_size=2)
    shard_paths(tmp_path, 1)[1].unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_optimizer_state(tmp_path, torch.optim.AdamW([w]), [("w", w)], saved_world_size=2)


def test_fsdp_optimizer_state_round_trips_into_a_plain_model(tmp_path, group):
    from train.batches import collate
    from train.model import Policy, load_causal_lm, named_master_params
    from train.optim import build_optimizer
    from train.parallel import apply_parallelism
    from train.step import StepSettings, train_step
    from train.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "tiny", layers=2)
    policy = Policy(load_causal_lm(model_dir))
    model = apply_parallelism(policy, "fsdp", group, torch.float32)
    opt = build_optimizer(policy.parameters(), TrainConfig())
    mb = collate([{"prompt_ids": [1, 20, 21], "completion_ids": [22, 2]}], pad_id=0)
    train_step(model, list(policy.parameters()), opt, [mb], global_completion_tokens=2, lr=1e-3,
               settings=StepSettings(algorithm="sft", backend="fsdp", dtype=torch.float32), info=group)
    save_optimizer_shard(tmp_path / "ckpt", opt, named_master_params(policy), rank=0, world_size=1,
                         backend="fsdp", run_id="r")

    plain = Policy(load_causal_lm(model_dir))
    opt2 = build_optimizer(plain.parameters(), TrainConfig())
    n = load_optimizer_state(tmp_path / "ckpt", opt2, named_master_params(plain), saved_world_size=1)
    assert n == len(named_master_params(plain))
    for (name, p), (_, q) in zip(named_master_params(policy), named_master_params(plain)):
        assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), opt2.state[q]["exp_avg"]), name
        assert float(opt2.state[q]["step"]) == 1.0
