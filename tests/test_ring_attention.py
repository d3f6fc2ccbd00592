"""Ring attention (train/ring.py) on 4 torchrun processes (gloo) against causal attention of the
whole sequence in float64: outputs and the gradients of queries, keys and values, for 3 query
heads over 1 kv head (GQA; 2 and 4 divide neither), in two layouts: one ring of all 4 ranks
(3 shifts each way) and the (2, 2) mesh's two rings of 2, whose peers are not the global ranks
0 and 1 (the second group's ranks are 2 and 3); queries 3 at a time, so causal masks cut
inside a chunk and chunks stop short of a slice's end.

Tolerance: the ring works in float32 and merges blocks by log-sum-exp; each value passes through
a D=16 term dot product, an exp, a sum of at most T=32 terms, up to 3 rescales and a 32-term
matmul, each rounding by 2^-24 relative: about 4 + 1 + 5 + 3 + 5 = 18 roundings, 1.1e-6 of values
of magnitude below 4, so 1e-5 (gradients, one more matmul of 32 terms: the same bound).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests import train_support as ts

S, HEADS, KV_HEADS, D = 8, 3, 1, 16
TOL = 1e-5


def _reference(q, k, v, grad_out):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                           v.repeat_interleave(rep, 1), is_causal=True)
    out.transpose(1, 2).backward(grad_out.double())
    return out.transpose(1, 2), q.grad, k.grad, v.grad


def _errors(cp_rank, cp: int, group) -> dict[str, float]:
    from train.context import ContextParallel
    from train.ring import ring_attention

    g = torch.Generator().manual_seed(cp)
    t = S * cp
    q, k, v = (torch.randn(2, h, t, D, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    grad_out = torch.randn(2, t, HEADS, D, generator=g)
    ref = _reference(q, k, v, grad_out)
    part = slice(cp_rank * S, (cp_rank + 1) * S)
    mine = [x[:, :, part].clone().requires_grad_() for x in (q, k, v)]
    out, _ = ring_attention(None, *mine, None, context_parallel=ContextParallel(cp, cp_rank, group))
    out.backward(grad_out[:, part])
    got = [out] + [x.grad for x in mine]
    want = [ref[0][:, part]] + [r[:, :, part] for r in ref[1:]]
    return {name: (a.double() - b).abs().max().item() for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from train.distributed import init_distributed, shutdown

    import train.ring

    # Chunks of 3 queries: a slice of 8 spans three, the last one short.
    train.ring.QUERY_CHUNK = 3
    info = init_distributed(120.0)
    try:
        whole = _errors(info.rank, 4, dist.group.WORLD)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp_replicate", "cp"))
        pairs = _errors(mesh.get_local_rank("cp"), 2, mesh.get_group("cp"))
        (out / f"{info.rank}.json").write_text(json.dumps({"ring4": whole, "ring2": pairs}))
    finally:
        shutdown()


def test_ring_attention_equals_causal_attention_with_gradients_for_heads_cp_does_not_divide(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    codes = ts.torchrun("tests.test_ring_attention", [str(out)], tmp_path / "logs", nnodes=1, nproc_per_node=4)
    assert codes == [0], ts.logs_text(tmp_path / "logs")
    errors = [json.loads((out / f"{r}.json").read_text()) for r in range(4)]
    for rank, e in enumerate(errors):
        for layout in ("ring4", "ring2"):
            assert set(e[layout]) == {"out", "dq", "dk", "dv"}
            assert max(e[layout].values()) <= TOL, (rank, layout, e[layout])


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
