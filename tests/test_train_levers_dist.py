"""The levers on 2 processes (torchrun, gloo): DDP and FSDP2, each lever against the plain trainer.

One torchrun launch runs every case of a group in turn (`python -m tests.test_train_levers_dist`
is the worker): the same global batch of 8 samples split over the 2 ranks, two AdamW steps.
Rank 0 writes each case's per-step loss and gradient norm and its final full weights. The test
compares every case with the plain FSDP2 run on the same launch.

Tolerances: losses and gradient norms within 1e-6 (float32, the same arithmetic in another
order); weights after two AdamW steps at lr 1e-4 within 1e-6. The chunked LM head sums its
weight gradient chunk by chunk: gradients agree within 1e-5 (test_train_levers.py), and Adam,
which divides each update by the gradient's own scale, turns the rounding of near-zero gradients
into weight differences of up to ~2e-6 after two steps, so its weights are held to 1e-5 (a tenth
of one step's update). LoRA changes what is trained, so its cases are compared with each other
(DDP vs FSDP2) and with the plain first-step loss (B = 0).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests import train_support as ts

PLAIN = {"fused_lm_head_token_chunk_size": "disabled"}
GROUPS = {
    "fsdp2-options": {
        "fsdp": {},
        "ddp": {"backend": "ddp"},
        "fsdp-no-reshard": {"reshard_after_forward": False},
        "hsdp-2x1": {"dp_replicate": 2},
        "fsdp-cpu-offload": {"fsdp_cpu_offload": True},
        "fsdp-optim-offload": {"optim_cpu_offload": True},
        "ddp-optim-offload": {"backend": "ddp", "optim_cpu_offload": True},
    },
    "model-levers": {
        "fsdp": {},
        "fsdp-ac-offloading": {"ac": {"freq": 1}, "ac_offloading": {"enabled": True}},
        "ddp-ac-selective": {"backend": "ddp", "ac": {"freq": 2, "mode": "selective"}},
        "fsdp-chunked": {"fused_lm_head_token_chunk_size": 8},
        "ddp-chunked": {"backend": "ddp", "fused_lm_head_token_chunk_size": "auto"},
        "fsdp-lora": {"lora": {"rank": 4, "alpha": 8.0}},
        "ddp-lora": {"backend": "ddp", "lora": {"rank": 4, "alpha": 8.0}},
    },
}
LOSS_TOL = 1e-6
WEIGHT_TOL = 1e-6
CHUNKED_WEIGHT_TOL = 1e-5


def _rows(vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(8):
        n = 14 + i
        ids = torch.randint(4, vocab, (n,), generator=g).tolist()
        rows.append({"prompt_ids": [1] + ids[:5], "completion_ids": ids[5:],
                     "logprobs": (-4.7 + 0.2 * torch.rand(n - 5, generator=g)).tolist(), "advantage": (-1.0) ** i})
    return rows


def two_steps_saved(t, cfg, info, rows: list[dict], mb, path: Path) -> dict:
    """Collective: two GRPO steps of the trainable `t` on this rank's micro-batch `mb` of `rows`,
    then the full weights at `path` (rank 0); the steps' losses and gradient norms."""
    from safetensors.torch import save_file

    from train.parallel import full_state_dict
    from train.step import StepSettings, train_step

    total = sum(len(r["completion_ids"]) for r in rows)
    settings = StepSettings(algorithm="grpo", backend=cfg.backend, dtype=t.dtype)
    steps = [train_step(t.model, t.params, t.optimizer, [mb], global_completion_tokens=total, lr=cfg.lr,
                        settings=settings, info=info, router_loss=t.router_loss) for _ in range(2)]
    weights = full_state_dict(t.policy)
    if info.is_main:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    return {"loss": [s.loss for s in steps], "grad_norm": [s.grad_norm for s in steps],
            "aux_loss": [s.aux_loss for s in steps]}


def worker(model: Path, out: Path, group: str) -> None:
    """Every rank: for each case, build, train two steps on this rank's half of the batch; rank 0
    writes the results."""
    import torch
    from coordination.config import from_dict
    from train.batches import collate
    from train.build import load_model, make_trainable
    from train.config import TrainConfig
    from train.distributed import init_distributed, shutdown

    info = init_distributed(120.0)
    results = {}
    try:
        for name, levers in GROUPS[group].items():
            cfg = from_dict(TrainConfig, {**PLAIN, "lr": 1e-4, **levers})
            torch.manual_seed(0)
            t = make_trainable(load_model(cfg, model, None), cfg, info)
            rows = _rows(t.policy.lm.config.vocab_size)
            mb = collate(rows[info.rank::info.world_size], pad_id=0)
            results[name] = {**two_steps_saved(t, cfg, info, rows, mb, out / f"{name}.safetensors"),
                             "checkpointed_blocks": t.checkpointed_blocks}
        if info.is_main:
            (out / "results.json").write_text(json.dumps(results))
    finally:
        shutdown()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ts.make_tiny(tmp_path_factory.mktemp("base") / "tiny", layers=2)


def _launch(base: Path, tmp_path: Path, group: str) -> tuple[dict, Path]:
    out = tmp_path / group
    out.mkdir()
    codes = ts.torchrun("tests.test_train_levers_dist", [str(base), str(out), group], tmp_path / "logs",
                        nnodes=1, nproc_per_node=2)
    assert codes == [0], ts.logs_text(tmp_path / "logs")
    return json.loads((out / "results.json").read_text()), out


def _weights(out: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / f"{name}.safetensors"))


def _assert_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= tol, worst


def test_fsdp2_options_and_optimizer_offload_on_two_processes_match_plain_fsdp2_and_ddp(base, tmp_path):
    results, out = _launch(base, tmp_path, "fsdp2-options")
    plain = results["fsdp"]
    plain_weights = _weights(out, "fsdp")
    for name, r in results.items():
        assert r["loss"] == pytest.approx(plain["loss"], abs=LOSS_TOL), name
        assert r["grad_norm"] == pytest.approx(plain["grad_norm"], abs=LOSS_TOL), name
        _assert_close(_weights(out, name), plain_weights, WEIGHT_TOL)
    assert plain["loss"][0] != plain["loss"][1]       # the first step changed the model


@pytest.mark.slow
def test_checkpointing_offloading_chunked_head_and_lora_on_two_processes_match_plain(base, tmp_path):
    results, out = _launch(base, tmp_path, "model-levers")
    plain = results["fsdp"]
    plain_weights = _weights(out, "fsdp")
    for name in ("fsdp-ac-offloading", "ddp-ac-selective", "fsdp-chunked", "ddp-chunked"):
        assert results[name]["loss"] == pytest.approx(plain["loss"], abs=LOSS_TOL), name
        assert results[name]["grad_norm"] == pytest.approx(plain["grad_norm"], abs=LOSS_TOL), name
        _assert_close(_weights(out, name), plain_weights, CHUNKED_WEIGHT_TOL if "chunked" in name else WEIGHT_TOL)
    assert results["fsdp-ac-offloading"]["checkpointed_blocks"] == 2
    assert results["ddp-ac-selective"]["checkpointed_blocks"] == 1
    fsdp_lora, ddp_lora = results["fsdp-lora"], results["ddp-lora"]
    assert fsdp_lora["loss"][0] == pytest.approx(plain["loss"][0], abs=LOSS_TOL)   # B = 0: the plain model
    assert fsdp_lora["loss"] == pytest.approx(ddp_lora["loss"], abs=LOSS_TOL)
    lora_weights = _weights(out, "fsdp-lora")
    _assert_close(lora_weights, _weights(out, "ddp-lora"), WEIGHT_TOL)
    adapters = [k for k in lora_weights if ".lora_B." in k]
    assert adapters and all(lora_weights[k].abs().max() > 0 for k in adapters)     # the adapters trained
    initial = ts.load_weights(base)
    frozen = [k for k in lora_weights if ".lora_" not in k]
    assert len(frozen) == len(initial)
    for key in frozen:   # the base weights did not move
        assert torch.equal(lora_weights[key], initial[key.replace(".base_layer", "")]), key


if __name__ == "__main__":
    from train.launch import run_worker

    run_worker(worker, Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])


@pytest.mark.slow
def test_hsdp_2x2_trains_like_one_process_and_its_optimizer_state_reshards_into_one(base, tmp_path):
    """4 trainer processes as 2 replicas x 2 shards: the same update as one process, and the
    optimizer state written by the 4 ranks (Replicate x Shard(0) placements) continues in one."""
    from coordination.layout import RunLayout
    from coordination.records import read_record

    runs = {}
    for name, world, extra in (("hsdp", 4, {"dp_replicate": 2}), ("one", 1, {})):
        layout = RunLayout(tmp_path / name)
        ts.write_trajectories(layout, 1, base)
        plan = ts.prepare(layout, 1, base, 0, world_size=world, **extra)
        if world == 1:
            codes = [ts.run_module("train.trainer", ["--plan", str(plan)], tmp_path / f"{name}.log")]
        else:
            codes = ts.torchrun("train.trainer", ["--plan", str(plan)], tmp_path / f"logs-{name}", nnodes=1,
                                nproc_per_node=world)
        assert codes == [0], ts.logs_text(tmp_path / f"logs-{name}") if world > 1 else ""
        ts.publish(plan)
        runs[name] = layout
    assert "HSDP 2x2" in ts.logs_text(tmp_path / "logs-hsdp")
    _assert_close(ts.load_weights(runs["hsdp"].checkpoint(1)), ts.load_weights(runs["one"].checkpoint(1)), WEIGHT_TOL)
    layout = runs["hsdp"]
    # DCP writes each replicated piece once: at least one file per shard group, at most one per rank.
    assert 2 <= len(list((layout.checkpoint(1) / "optimizer").glob("shard-*.safetensors"))) <= 4
    ts.write_trajectories(layout, 2, layout.checkpoint(1), seed=1, policy_iteration=1)
    plan2 = ts.prepare(layout, 2, layout.checkpoint(1), 1, world_size=1)
    assert ts.run_module("train.trainer", ["--plan", str(plan2)], tmp_path / "iter2.log") == 0, \
        (tmp_path / "iter2.log").read_text()
    ts.publish(plan2)
    assert "optimizer step 4)" in (tmp_path / "iter2.log").read_text()
    assert read_record(layout.checkpoint(2) / "trainer_state.json").data["optimizer_step"] == 8
