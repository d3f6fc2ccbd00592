"""The load-balancing loss (train/router_loss.py) in one process: the value and the gradient of
transformers' own `aux_loss`, for both MoE families, with padding left out; off when the config
does not ask for it. (Its global form over ranks and EP: tests/test_expert_aux_loss_dist.py.)

Tolerance: the same float32 softmax and sums as transformers', added in another order, on values
near 1-2: a few ulps (2.4e-7), so 1e-6; gradients are of the same size, same tolerance."""
from __future__ import annotations

import json

import pytest
import torch

from tests import train_support as ts

TOL = 1e-6


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = ts.make_tiny(tmp_path_factory.mktemp(request.param) / "m", layers=2, experts=4, top_k=2,
                        family=request.param, router_aux_loss_coef=0.02)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 90, (3, 11), generator=g)
    mask = torch.ones(3, 11)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask


def test_router_loss_equals_transformers_aux_loss_and_its_gradient_padding_left_out(moe):
    from train.router_loss import RouterLoss, router_modules

    ids, mask = _batch()
    gates = [g.weight for g in router_modules(moe)]
    assert len(gates) == 2
    ref = moe(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    ref_grads = torch.autograd.grad(ref, gates)
    router = RouterLoss.for_model(moe)
    assert router.coef == pytest.approx(0.02) and router.num_experts == 4 and router.top_k == 2
    with router.capture():
        moe.model(input_ids=ids, attention_mask=mask)
    aux = router.take(mask)
    assert aux.value.item() == pytest.approx(ref.item(), abs=TOL)
    assert aux.local_share.item() == pytest.approx(ref.item(), abs=TOL)   # one process: the share is all of it
    for got, want in zip(torch.autograd.grad(aux.local_share, gates), ref_grads):
        assert (got - want).abs().max().item() <= TOL
    # Padding counts: changing a padded token's id changes nothing; without the mask it would.
    ids2 = ids.clone()
    ids2[2, 6] = 5 if ids[2, 6] != 5 else 6
    with router.capture():
        moe.model(input_ids=ids2, attention_mask=mask)
    assert router.take(mask).value.item() == pytest.approx(aux.value.item(), abs=TOL)


def test_router_loss_refuses_a_forward_it_did_not_record(moe):
    from train.router_loss import RouterLoss

    router = RouterLoss.for_model(moe)
    ids, mask = _batch()
    moe.model(input_ids=ids, attention_mask=mask)           # outside capture(): nothing recorded
    with pytest.raises(RuntimeError, match="recorded 0 router outputs"):
        router.take(mask)


def test_no_router_loss_unless_the_config_asks_for_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from train.router_loss import RouterLoss

    off = ts.make_tiny(tmp_path / "off", layers=1, experts=4, top_k=2)
    assert json.loads((off / "config.json").read_text())["output_router_logits"] is False
    assert RouterLoss.for_model(AutoModelForCausalLM.from_pretrained(str(off))) is None
    dense = ts.make_tiny(tmp_path / "dense", layers=1)
    assert RouterLoss.for_model(AutoModelForCausalLM.from_pretrained(str(dense))) is None
