"""Expert parallelism (train.ep=2) on 2 torchrun processes (gloo) against ep=1 and one process.

One torchrun launch (`python -m tests.test_train_expert_parallel` is the worker) builds the tiny
Qwen3-MoE (4 experts, top-2) twice, as ep=1 (FSDP2 shards every weight) and as ep=2 (each rank
holds 2 whole experts per layer; tokens reach them by all_to_all_single). For each, every rank
writes the per-token logprobs of its half of a batch before training and the bytes of expert
weights it holds; then two AdamW steps; rank 0 writes the losses, gradient norms and full weights.
Last, each rank loads ep=2 from a copy of the model whose experts 2 and 3 are NaN.

Tolerances: the logprobs are compared with one process running transformers' own forward on
the whole batch: the same float32 arithmetic with the expert outputs summed in another order,
a few ulps of values near 5 (ulp 4.8e-7), so 1e-5. Losses and gradient norms within 1e-6 as in
the other two-process lever tests; weights after two AdamW steps at lr 1e-4 within 1e-6 (a
hundredth of one step's update; measured 4.4e-7: the experts' gradients are summed in another
order, which Adam's division by the gradient's own scale turns into weight differences).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests import train_support as ts
from tests.test_train_levers_dist import _rows, two_steps_saved

CASES = {"ep1": {}, "ep2": {"ep": 2}}
LOGP_TOL = 1e-5
LOSS_TOL = 1e-6
WEIGHT_TOL = 1e-6


def worker(model: Path, out: Path, poisoned: Path) -> None:
    from safetensors.torch import save_file

    from coordination.config import from_dict
    from train.batches import collate
    from train.build import load_model, make_trainable
    from train.config import TrainConfig
    from train.distributed import init_distributed, shutdown
    from train.expert import expert_bytes, expert_bytes_computing

    info = init_distributed(120.0)
    results = {}
    try:
        for name, levers in CASES.items():
            cfg = from_dict(TrainConfig, {"fused_lm_head_token_chunk_size": "disabled", "lr": 1e-4, **levers})
            torch.manual_seed(0)
            t = make_trainable(load_model(cfg, model, None), cfg, info)
            rows = _rows(t.policy.lm.config.vocab_size)
            mb = collate(rows[info.rank::info.world_size], pad_id=0)
            with torch.no_grad():
                logp, _ = t.model(mb.input_ids, mb.attention_mask, mb.targets)
            save_file({"logp": logp.contiguous(), "mask": mb.loss_mask.contiguous()},
                      str(out / f"{name}-logp-{info.rank}.safetensors"))
            (out / f"{name}-expert-bytes-{info.rank}").write_text(str(expert_bytes(t.policy.lm)))
            (out / f"{name}-expert-bytes-computing-{info.rank}").write_text(str(expert_bytes_computing(t.policy.lm)))
            results[name] = two_steps_saved(t, cfg, info, rows, mb, out / f"{name}.safetensors")
            if name == "ep2":
                results[f"offload-{info.rank}"] = _offload_round_trip(t, info.device)
        # Sharded load from a copy whose experts 2 and 3 are NaN: each rank reads only its own experts.
        cfg = from_dict(TrainConfig, {"ep": 2})
        loaded = load_model(cfg, poisoned, None)
        t = make_trainable(loaded, cfg, info)
        experts = t.policy.lm.model.layers[0].mlp.experts
        local = experts.gate_up_proj.to_local()
        results[f"poisoned-{info.rank}"] = {"sharded": loaded.sharded, "finite": bool(local.isfinite().all()),
                                            "local_experts": local.shape[0]}
        save_file({"gate_up_proj": local.contiguous()}, str(out / f"poisoned-gate-up-{info.rank}.safetensors"))
        ts.write_gathered(results, out, info)
    finally:
        shutdown()


def _offload_round_trip(t, device) -> dict:
    """The resident trainer's offload (train/offload.py) on an EP model: the experts' local shards and
    their Adam moments leave their storages and come back bit for bit."""
    from train.offload import ResidentOffload

    experts = t.policy.lm.model.layers[0].mlp.experts.gate_up_proj
    moments = t.optimizer.state[experts]
    before = [experts.to_local().clone(), moments["exp_avg"].to_local().clone()]
    off = ResidentOffload([t.policy], t.optimizer, device)
    off.to_host()
    emptied = experts.to_local().untyped_storage().nbytes() == 0 and \
        moments["exp_avg"].to_local().untyped_storage().nbytes() == 0
    off.to_device()
    after = [experts.to_local(), moments["exp_avg"].to_local()]
    return {"emptied": emptied, "restored": all(torch.equal(a, b) for a, b in zip(before, after))}


def _poison_experts(model: Path, out: Path, experts: tuple[int, ...]) -> Path:
    """A copy of `model` whose per-expert tensors of `experts` are NaN in the weight file."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    weights = load_file(str(out / "model.safetensors"))
    for key in weights:
        if any(f".experts.{e}." in key for e in experts):
            weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    model = ts.make_tiny(root / "tiny-moe", layers=2, experts=4, top_k=2)
    out = root / "out"
    out.mkdir()
    poisoned = _poison_experts(model, root / "poisoned", (2, 3))
    codes = ts.torchrun("tests.test_train_expert_parallel", [str(model), str(out), str(poisoned)], root / "logs",
                        nnodes=1, nproc_per_node=2)
    assert codes == [0], ts.logs_text(root / "logs")
    return model, out, json.loads((out / "results.json").read_text())


def _reference_logp(model: Path) -> list[torch.Tensor]:
    """Per-token logprobs of each rank's half of the batch from one process and transformers' forward."""
    from transformers import AutoModelForCausalLM

    from train.batches import collate

    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    rows = _rows(lm.config.vocab_size)
    out = []
    for rank in range(2):
        mb = collate(rows[rank::2], pad_id=0)
        with torch.no_grad():
            logits = lm(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
        out.append(torch.log_softmax(logits, -1).gather(-1, mb.targets.unsqueeze(-1)).squeeze(-1))
    return out


def test_ep2_logprobs_equal_one_process_and_its_update_equals_ep1(launched):
    from safetensors.torch import load_file

    model, out, results = launched
    for rank, ref in enumerate(_reference_logp(model)):
        for name in CASES:
            got = load_file(str(out / f"{name}-logp-{rank}.safetensors"))
            mask = got["mask"].bool()
            worst = (got["logp"] - ref)[mask].abs().max().item()
            assert worst <= LOGP_TOL, (name, rank, worst)
    ep1, ep2 = results["ep1"], results["ep2"]
    assert ep2["loss"] == pytest.approx(ep1["loss"], abs=LOSS_TOL)
    assert ep2["grad_norm"] == pytest.approx(ep1["grad_norm"], abs=LOSS_TOL)
    assert ep1["loss"][0] != ep1["loss"][1]          # the first step changed the model
    a, b = load_file(str(out / "ep1.safetensors")), load_file(str(out / "ep2.safetensors"))
    assert a.keys() == b.keys() and any(".experts.gate_up_proj" in k for k in a)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= WEIGHT_TOL, worst
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).state_dict()
    experts = [k for k in b if ".experts." in k]
    assert experts and all(not torch.equal(b[k], initial[k]) for k in experts)   # every expert tensor trained


def test_ep2_holds_half_of_the_expert_bytes_on_each_rank(launched):
    from transformers import AutoModelForCausalLM

    from train.expert import expert_bytes

    model, out, _ = launched
    whole = expert_bytes(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32))
    per_rank = [int((out / f"ep2-expert-bytes-{r}").read_text()) for r in range(2)]
    assert per_rank == [whole // 2, whole // 2]
    # 2 layers x 4 experts x (gate_up [384, 128] + down [128, 192]) float32 values (experts 384 / top-2 wide)
    assert whole == 2 * 4 * (384 * 128 + 128 * 192) * 4
    # While a layer runs: FSDP2 (ep=1) has gathered all of its experts, ep=2 holds its own two.
    computing = {name: [int((out / f"{name}-expert-bytes-computing-{r}").read_text()) for r in range(2)]
                 for name in CASES}
    assert computing == {"ep1": [whole // 2] * 2, "ep2": [whole // 4] * 2}


if __name__ == "__main__":
    from train.launch import run_worker

    run_worker(worker, Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))


def test_sharded_load_fills_each_ranks_experts_from_their_own_tensors_only(launched):
    """Experts 2 and 3 are NaN in the file: rank 0 (experts 0 and 1) reads none of them and holds
    exactly the model's values; rank 1 holds the NaNs, so its experts did come from the file."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, out, results = launched
    assert results["poisoned-0"] == {"sharded": True, "finite": True, "local_experts": 2}
    assert results["poisoned-1"] == {"sharded": True, "finite": False, "local_experts": 2}
    whole = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    local = load_file(str(out / "poisoned-gate-up-0.safetensors"))["gate_up_proj"]
    assert torch.equal(local, whole.model.layers[0].mlp.experts.gate_up_proj[:2])


def test_the_resident_offload_moves_the_expert_shards_and_their_moments_and_restores_them(launched):
    _, _, results = launched
    for rank in range(2):
        assert results[f"offload-{rank}"] == {"emptied": True, "restored": True}
