"""The memory plan under context parallelism: docs/design.md §10.5's third worked example
(Llama-2-7B at 64k-token micro-batches with train.cp=4 on 2 x 8 x 80 GiB), within 15 %, and cp
dividing exactly the terms that scale with the tokens a rank holds."""
from __future__ import annotations

import pytest

from tests.test_memory_plan import _both, _cfg, _model
from train.model_shape import GIB

# By hand (GiB = 2^30 B), configs/gpu-example.yaml on 2 nodes with micro_batch_tokens=65536 and
# cp=4: FSDP2 still shards over all 16 ranks; each rank holds 65536 / 4 = 16384 positions.
#   held: params 1.569, gathered 1.242, grads 1.569, AdamW 3.138 (as the first example),
#   kept activations (32 x 2 x 4096 + 8 x 4096) x 16384 = 4.500, fixed 3        -> 15.018
#   block recomputed: 186,496 x 16384 = 2.846; all-to-all buffers 2 x 2 x (4096 + 2 x 4096) x 16384
#   = 0.750; unsharded gradient 1.885; the head's bf16 gradient 0.244           -> 5.725
#   peak 20.74 (cp=1 at 64k tokens: 18.000 + 11.383 in those two rows, peak 42.03)
WORKED_CP = {"activations kept": 4.500, "activations of the block": 2.846, "all-to-all buffers": 0.750,
             "its unsharded": 1.885, "peak": 20.74}
LONG = "train.micro_batch_tokens=65536"


def _rows(plan, worked: dict[str, float] = WORKED_CP) -> dict[str, float]:
    t = plan.trainer
    out = {key: b / GIB for key in worked for name, b in t.rows + t.head + t.block if name.startswith(key)}
    out["peak"] = t.peak / GIB
    return out


def test_plan_of_a_7b_model_at_64k_tokens_with_cp_4_matches_the_worked_example(tmp_path):
    got = _rows(_both(_cfg(_model(tmp_path), LONG, "train.cp=4"), 2))
    for key, want in WORKED_CP.items():
        assert got[key] == pytest.approx(want, rel=0.15), key
    assert _both(_cfg(_model(tmp_path), LONG), 2).trainer.peak / GIB == pytest.approx(42.03, rel=0.15)


def test_cp_divides_the_token_terms_and_leaves_the_sharded_state_alone(tmp_path):
    model = _model(tmp_path)
    one, four = (_both(_cfg(model, LONG, *extra), 2).trainer for extra in ([], ["train.cp=4"]))
    by_name = {n.split(":")[0]: b for n, b in one.rows}
    cp_by_name = {n.split(":")[0]: b for n, b in four.rows}
    assert cp_by_name["activations kept"] == by_name["activations kept"] / 4
    for part in ("parameters", "gradients", "AdamW state", "gathered parameters"):
        assert cp_by_name[part] == by_name[part], part
    assert not any(n.startswith("all-to-all") for n, _ in one.block)


# The same with train.cp_kind=ring: no all-to-all buffers; per token the block adds float32 scaled
# queries, 4 blocks' float32 outputs and merges, logsumexps and 3 received kv slices:
# 4 x 4096 x (1 + 2 x 4) + 8 x 32 x 4 + 2 x 3 x 2 x 4096 = 197,632 B, so the block recomputed is
# (186,496 + 197,632) x 16384 = 5.862; one 512-query chunk's scores, probabilities and their
# gradients 4 x 4 x 32 x 512 x 16384 = 4.000; peak 15.018 + 5.862 + 4.000 + 1.885 + 0.244 = 27.01.
WORKED_RING = {"activations kept": 4.500, "activations of the block": 5.862, "ring attention": 4.000,
               "its unsharded": 1.885, "peak": 27.01}


def test_ring_counts_its_query_chunk_scores_and_kv_slices_instead_of_all_to_all_buffers(tmp_path):
    plan = _both(_cfg(_model(tmp_path), LONG, "train.cp=4", "train.cp_kind=ring"), 2)
    got = _rows(plan, WORKED_RING)
    for key, want in WORKED_RING.items():
        assert got[key] == pytest.approx(want, rel=0.01), key
    assert not any(n.startswith("all-to-all") for n, _ in plan.trainer.block)
