"""The load-balancing loss and Mixtral under expert parallelism, on 2 torchrun processes (gloo).

One launch (`python -m tests.test_expert_aux_loss_dist` is the worker) trains, for each family
(Qwen3-MoE and Mixtral, router_aux_loss_coef 0.1, output_router_logits on), ep=1 (FSDP2 over both
ranks) and ep=2 (2 experts per rank) for two GRPO steps on the same global batch; then the
Qwen3-MoE model with the coefficient 0 and the same model with the loss switched off; last, the
Mixtral ep=2 run publishes a checkpoint (each rank writes its own experts).

The aux loss of a step is that of the global batch: the worker also writes the rank's rows so the
test can compute transformers' own aux_loss over both ranks' rows in one process.
Tolerances: losses, gradient norms and the aux loss (values near 1-2 summed in another order) 1e-6,
logprobs 1e-5 as in tests/test_train_expert_parallel.py; weights after two AdamW steps at lr 1e-4
within 2e-6, a hundredth of the most two steps can move a weight (2 x lr): Adam divides each
gradient by its own scale, so a near-zero gradient summed in another order moves its weight by a
visibly different amount (measured 1.2e-6 on Mixtral).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests import train_support as ts
from tests.test_train_levers_dist import _rows, two_steps_saved

TOL = 1e-6
WEIGHT_TOL = 2e-6
LOGP_TOL = 1e-5
COEF = 0.1
CASES = [("qwen3_moe", "ep1", {}), ("qwen3_moe", "ep2", {"ep": 2}), ("mixtral", "ep1", {}),
         ("mixtral", "ep2", {"ep": 2}), ("coef0", "ep2", {"ep": 2}), ("off", "ep2", {"ep": 2})]
RUN_ID = "aux-ep"


def worker(root: Path, out: Path) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from coordination.config import from_dict
    from train.batches import collate
    from train.build import load_model, make_trainable
    from train.config import TrainConfig
    from train.distributed import init_distributed, shutdown
    from train.export import prepare_output_dir, save_checkpoint

    info = init_distributed(120.0)
    results = {}
    try:
        for model, name, levers in CASES:
            cfg = from_dict(TrainConfig, {"fused_lm_head_token_chunk_size": "disabled", "lr": 1e-4, **levers})
            torch.manual_seed(0)
            loaded = load_model(cfg, root / model, None)
            t = make_trainable(loaded, cfg, info)
            rows = _rows(t.policy.lm.config.vocab_size)
            mb = collate(rows[info.rank::info.world_size], pad_id=0)
            key = f"{model}-{name}"
            with torch.no_grad():
                logp, _ = t.model(mb.input_ids, mb.attention_mask, mb.targets)
            save_file({"logp": logp.contiguous(), "mask": mb.loss_mask.contiguous()},
                      str(out / f"{key}-logp-{info.rank}.safetensors"))
            results[key] = two_steps_saved(t, cfg, info, rows, mb, out / f"{key}.safetensors")
            results[key]["sharded"] = loaded.sharded
            if key == "mixtral-ep2":
                experts = t.policy.lm.model.layers[0].mlp.experts.gate_up_proj
                results[f"local-experts-{info.rank}"] = experts.to_local().shape[0]
                staging = out / "published"
                prepare_output_dir(staging, info)
                dist.barrier()
                save_checkpoint(staging, policy=t.policy, optimizer=t.optimizer, info=info, backend=cfg.backend,
                                run_id=RUN_ID, iteration=1, tokenizer_source=root / model,
                                trainer_state={"optimizer_step": 2, "iteration": 1})
        gathered = [None] * info.world_size
        dist.all_gather_object(gathered, results)
        if info.is_main:
            (out / "results.json").write_text(json.dumps({k: v for r in gathered for k, v in r.items()}))
    finally:
        shutdown()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("aux-ep")
    for name, family, coef in (("qwen3_moe", "qwen3_moe", COEF), ("mixtral", "mixtral", COEF),
                               ("coef0", "qwen3_moe", 0.0), ("off", "qwen3_moe", 0.0)):
        ts.make_tiny(root / name, layers=2, experts=4, top_k=2, family=family, router_aux_loss_coef=coef)
    # coef0: the loss is computed (and logged) but weighs nothing; off: not computed at all.
    config = json.loads((root / "coef0" / "config.json").read_text())
    (root / "coef0" / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    out = root / "out"
    out.mkdir()
    codes = ts.torchrun("tests.test_expert_aux_loss_dist", [str(root), str(out)], root / "logs",
                        nnodes=1, nproc_per_node=2)
    assert codes == [0], ts.logs_text(root / "logs")
    return root, out, json.loads((out / "results.json").read_text())


def _global_aux(model: Path) -> float:
    """transformers' aux_loss of the untrained model over both ranks' rows in one forward."""
    from transformers import AutoModelForCausalLM

    from train.batches import collate

    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    mb = collate(_rows(lm.config.vocab_size), pad_id=0)
    with torch.no_grad():
        return lm(input_ids=mb.input_ids, attention_mask=mb.attention_mask, output_router_logits=True).aux_loss.item()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_ep2_aux_loss_is_the_global_batchs_and_its_update_equals_ep1(launched, family):
    from safetensors.torch import load_file

    root, out, results = launched
    ep1, ep2 = results[f"{family}-ep1"], results[f"{family}-ep2"]
    assert ep1["sharded"] and ep2["sharded"]
    first = _global_aux(root / family)
    assert ep1["aux_loss"][0] == pytest.approx(first, abs=TOL)
    for key in ("aux_loss", "loss", "grad_norm"):
        assert ep2[key] == pytest.approx(ep1[key], abs=TOL), key
    assert ep1["aux_loss"][0] != ep1["aux_loss"][1]     # the first step moved the routers
    a, b = load_file(str(out / f"{family}-ep1.safetensors")), load_file(str(out / f"{family}-ep2.safetensors"))
    assert a.keys() == b.keys()
    worst = max(((a[k] - b[k]).abs().max().item(), k) for k in a)
    assert worst[0] <= WEIGHT_TOL, worst
    for rank in range(2):
        x = load_file(str(out / f"{family}-ep1-logp-{rank}.safetensors"))
        y = load_file(str(out / f"{family}-ep2-logp-{rank}.safetensors"))
        assert (x["logp"] - y["logp"])[x["mask"].bool()].abs().max().item() <= LOGP_TOL


def test_the_aux_loss_moves_the_routers_and_a_coefficient_of_0_changes_nothing(launched):
    from safetensors.torch import load_file

    _, out, results = launched
    coef0, off = results["coef0-ep2"], results["off-ep2"]
    assert coef0["aux_loss"][0] > 0 and off["aux_loss"] == [0.0, 0.0]
    assert coef0["loss"] == off["loss"] and coef0["grad_norm"] == off["grad_norm"]
    a, b = load_file(str(out / "coef0-ep2.safetensors")), load_file(str(out / "off-ep2.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The same model with the coefficient 0.1 trains its routers differently.
    with_aux = load_file(str(out / "qwen3_moe-ep2.safetensors"))
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(with_aux[gate], a[gate])


def test_mixtral_published_by_its_expert_owners_loads_in_transformers_with_the_trained_weights(launched):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, out, results = launched
    assert results["local-experts-0"] == results["local-experts-1"] == 2
    published = out / "published"
    stored = set()
    for f in published.glob("*.safetensors"):
        stored |= set(load_file(str(f)))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in stored
    assert not any("gate_up_proj" in k or ".mlp." in k for k in stored)
    lm = AutoModelForCausalLM.from_pretrained(str(published), dtype=torch.float32)
    trained = load_file(str(out / "mixtral-ep2.safetensors"))
    state = lm.state_dict()
    # Published in the serving dtype (float32 on CPU): exactly the trained weights.
    assert all(torch.equal(state[k], v) for k, v in trained.items())


if __name__ == "__main__":
    from train.launch import run_worker

    run_worker(worker, Path(sys.argv[1]), Path(sys.argv[2]))
