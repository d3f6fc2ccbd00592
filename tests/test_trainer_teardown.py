"""One model at a time (docs/design.md §9.6): a held model is torn down before another is built.

In this process: tearing down a trained FSDP2 model frees every storage of its parameters and
AdamW state at once, even one a caller still refers to, and lets the module objects go (FSDP2's
reference cycles included). With real processes (`-m slow`): a resident trainer under torchrun that
rebuilds its ~200M-parameter model for a plan with another config reaches no higher peak RSS than
its first build did, give or take 30% of one model-and-optimizer.
"""
from __future__ import annotations

import weakref

import pytest
import torch

from tests import train_support as ts


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return ts.make_tiny(tmp_path_factory.mktemp("base") / "tiny", layers=2)


def _trained_held(base, info):
    """A Held as load_held makes it (FSDP2, AdamW), after one optimizer step, with its offload."""
    from coordination.config import from_dict
    from train.batches import collate
    from train.build import load_model, make_trainable
    from train.config import TrainConfig
    from train.offload import ResidentOffload
    from train.trainer import Held

    cfg = from_dict(TrainConfig, {"fused_lm_head_token_chunk_size": "disabled"})
    assert cfg.backend == "fsdp"
    t = make_trainable(load_model(cfg, base, None), cfg, info)
    mb = collate([{"prompt_ids": [1, 5, 6, 7], "completion_ids": [8, 9, 10, 2], "logprobs": [-4.6] * 4,
                   "advantage": 1.0}], pad_id=0)
    logp, _ = t.model(mb.input_ids, mb.attention_mask, mb.targets, 1.0)
    logp.sum().backward()
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    held = Held(cfg, {}, t, None, 1, 0, 1)
    held.offload = ResidentOffload([t.model], t.optimizer, info.device)
    return held


def _local(p):
    from torch.distributed.tensor import DTensor

    return p._local_tensor if isinstance(p, DTensor) else p


@pytest.mark.parametrize("offloaded", [False, True])
def test_tear_down_frees_parameters_and_adam_state_even_where_still_referenced(base, process_group, offloaded):
    held = _trained_held(base, process_group)
    params = sum(p.numel() for p in held.t.params)
    buffers = sum(b.numel() * b.element_size() for b in held.t.model.buffers())
    kept = held.t.params[0]  # a reference from outside, as a closure or a traceback frame would hold
    module, optimizer = weakref.ref(held.t.model), weakref.ref(held.t.optimizer)
    if offloaded:  # between iterations the storages are empty and the bytes are in the offload's copies
        held.offload.to_host()
        copies = weakref.ref(held.offload._saved[0][1])
        held.offload.to_device()
        held.offload.to_host()
    # float32 parameters and AdamW's two moments (no gradients after zero_grad), plus the buffers:
    # in their storages, or offloaded, in the host copies that are let go instead
    assert held.tear_down(process_group.device) == 12 * params + buffers
    assert _local(kept).untyped_storage().nbytes() == 0
    assert module() is None and optimizer() is None, "the module or optimizer outlived the tear-down"
    if offloaded:
        assert copies() is None, "the offload's host copy outlived the tear-down"
    assert held.t is None and held.reference is None and held.offload is None
    assert held.tear_down(process_group.device) == 0


def test_tear_down_refuses_while_the_optimizer_state_is_being_written(base, process_group):
    held = _trained_held(base, process_group)
    held.pending = object()
    with pytest.raises(RuntimeError, match="settle the write"):
        held.tear_down(process_group.device)
    assert all(_local(p).untyped_storage().nbytes() > 0 for p in held.t.params)


def _order(layout, launch: str, seq: int, **data) -> None:
    """What the driver's ResidentTrainer.order publishes for node 0."""
    from coordination.records import ensure_dir, publish_record
    from train.resident import ORDER_KIND

    path = layout.job("both").trainer_order(0, launch, seq)
    ensure_dir(path.parent)
    publish_record(path, ORDER_KIND, {"seq": seq, "launch": launch, **data}, run_id="run-t", generation=1)


def _wait_events(layout, event: str, count: int, proc, log, timeout: float = 300.0) -> dict:
    """Until node 0's trainer timeline holds `count` events `event`; the last of them."""
    import time

    from coordination import timeline

    deadline = time.monotonic() + timeout
    while True:
        seen = [e for e in timeline.read(layout.job("both").trainer_timeline(0)) if e["event"] == event]
        if len(seen) >= count:
            return seen[-1]
        assert proc.poll() is None, f"the resident trainer exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {event} #{count} within {timeout:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_resident_trainer_that_rebuilds_its_200m_model_holds_one_model_at_a_time(tmp_path):
    """A checkpoint of the ~200M model with its AdamW state (the per-iteration trainer, one step);
    then a resident trainer under torchrun loads it (early-load order) and loads it again (a second
    order rebuilds the held model). The rebuild raises the process's peak RSS by less than 30% of
    one model-and-optimizer (float32 parameters and two AdamW moments: 12 bytes per parameter),
    where holding the old model through the load would add all of it."""
    import json

    from coordination.layout import RunLayout
    from coordination.net import free_port
    from coordination.procgroup import stop_group
    from bench.load_publish import bench_model
    from train.config import TrainConfig
    from train.data import model_inputs
    from train.launch import torchrun_command
    from train.memory import peak_rss_mb, rss_mb
    from train.resident import STATE_KIND

    model = bench_model(tmp_path / "model")
    params = json.loads((model / "baton-tiny.json").read_text())["parameters"]
    held_mb = 12 * params / 2**20
    layout = RunLayout(tmp_path / "run")
    ts.write_trajectories(layout, 1, model, tasks=2, samples=2)
    plan = ts.prepare(layout, 1, model, 0, steps_per_iteration=1)
    log = tmp_path / "trainer.log"
    assert ts.run_module("train.trainer", ["--plan", str(plan)], tmp_path / "iter1.log", timeout=600) == 0, \
        (tmp_path / "iter1.log").read_text()[-3000:]
    ts.publish(plan)
    inputs = model_inputs(TrainConfig(micro_batch_tokens=64, steps_per_iteration=1), iteration=2, world_size=1,
                          input_checkpoint=layout.checkpoint(1), input_iteration=1)
    launch, port = "teardown-1", free_port("127.0.0.1")
    cmd = torchrun_command(python=ts.PYTHON, nnodes=1, node_rank=0, nproc_per_node=1,
                           rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=launch, is_host=True, local_addr=None,
                           module="train.trainer", args=["--resident", launch, "--log-path", str(layout.root),
                                                         "--job", "both", "--for-node", "0"])
    proc = ts.start(cmd, log)
    try:
        _wait_events(layout, "idle", 1, proc, log)
        from coordination.records import read_record

        pid = read_record(layout.job("both").trainer_state(0, 0), kind=STATE_KIND).data["pid"]
        baseline = rss_mb(pid)
        _order(layout, launch, 1, prepare=inputs)
        _wait_events(layout, "idle", 2, proc, log)
        first_peak, first_rss = peak_rss_mb(pid), rss_mb(pid)
        _order(layout, launch, 2, prepare=inputs)
        _wait_events(layout, "idle", 3, proc, log)
        second_peak, second_rss = peak_rss_mb(pid), rss_mb(pid)
        numbers = (f"one model-and-optimizer {held_mb:.0f} MiB; RSS before loading {baseline:.0f} MiB, after the "
                   f"first load {first_rss:.0f} MiB (peak {first_peak:.0f}), after the rebuild {second_rss:.0f} MiB "
                   f"(peak {second_peak:.0f})")
        print(numbers)
        assert first_rss - baseline >= held_mb, f"the first load holds less than one model-and-optimizer: {numbers}"
        assert second_peak - first_peak < 0.3 * held_mb, numbers
        assert "tore down the model it held before loading another" in log.read_text()
        _order(layout, launch, 3, stop=True)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        stop_group(proc, timeout=10)
