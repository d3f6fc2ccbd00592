"""train.cp=2 with train.cp_kind=ring on 2 torchrun processes (gloo) against cp=1, on a tiny
Llama whose 3 attention heads and 1 kv head 2 does not divide (Ulysses refuses it): the
machinery of tests/test_context_parallel.py on short rows (128 and 100 tokens, one layer), cheap
enough for the default tier. Its tolerances hold here too: fewer terms per sum than at 4096."""
from __future__ import annotations

import json

from tests import train_support as ts
from tests.test_context_parallel import assert_cp2_equals_cp1, launch

LENGTHS = (128, 100)


def test_ring_cp2_trains_a_model_whose_heads_two_does_not_divide_as_cp1_does(tmp_path):
    model = ts.make_tiny(tmp_path / "tiny", layers=1, hidden=96, heads=3, kv_heads=1, max_positions=256)
    assert json.loads((model / "config.json").read_text())["num_attention_heads"] == 3
    out, results = launch(tmp_path, model, LENGTHS, [(1, "ulysses"), (2, "ring")])
    assert_cp2_equals_cp1(model, out, results, LENGTHS, "cp2ring")
    for rank in range(2):
        assert results[f"cp2ring-{rank}"]["generated"] == results[f"cp1-{rank}"]["generated"]
