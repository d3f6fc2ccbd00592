"""Context parallelism (train.cp=2, Ulysses and ring) on 2 torchrun processes (gloo) against cp=1.

One torchrun launch (`python -m tests.test_context_parallel` is the worker) builds the tiny
Llama (4 heads, 2 kv heads, 2 layers) three times over the same 2 ranks: cp=1 (both ranks hold
the whole micro-batch: data parallel over identical data), cp=2 Ulysses and cp=2 ring (each
rank holds half of every row's 4096 positions). The micro-batch: two right-padded rows (4096
and 3000 tokens). For each, every rank writes its per-token logprobs, then one train_step
(GRPO, real old logprobs and advantages) with SGD; rank 0 writes the full gradients the
optimizer stepped with. Each rank also writes the bytes a forward of two unpadded 4096-token
rows saves for backward.

Tolerances. Logprobs: attention sums up to 4096 terms; under cp=2 each rank runs the causal
SDPA kernel on half the heads, so a sum may be split or ordered differently. Each float32
addition rounds by 2^-24 relative; a sum of n terms in another order differs by at most about
log2(n) * 2^-24 = 12 * 6e-8 = 7e-7 relative, and logprobs of magnitude ~4 through 2 layers, the
LM head and a logsumexp stay within a few ulps of 4 (ulp 4.8e-7): 1e-5. Measured: 0 (the
per-head kernels add in the same order). Ring sums each softmax in two blocks merged by
log-sum-exp (one more rounding per merge and an exp): the same few-ulp bound (measured 9.5e-7).
Gradients: a weight's gradient sums over all 7096 x 2 tokens, log2(14192) * 2^-24 = 8.5e-7 of
its largest entry; 1e-5 of it (measured 4.4e-7 Ulysses, 7.0e-7 ring).
Saved bytes are deterministic: measured ratio 0.530 on both ranks (103 MB against 195 MB);
ring 0.508 and 0.575 (rank 1 also keeps the received kv slice and a second block's output).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests import train_support as ts

# Two processes over 4096-token rows take about a minute on 2 loaded cores: the slow tier.
# tests/test_context_parallel_slices.py checks the slicing arithmetic in the default tier.
pytestmark = pytest.mark.slow

SEQ = 4096
LENGTHS = (4096, 3000)
LOGP_TOL = 1e-5
GRAD_TOL = 1e-5
# Ulysses keeps every per-token activation for half the positions; the all_to_all outputs
# (queries, keys, values and attention output over all positions of half the heads) are the
# same bytes as a slice's: about half of cp=1's, so 0.6 leaves margin for what does not split
# (ring's received kv slices and per-block outputs, which it keeps instead of the exchanges).
SAVED_RATIO_MAX = 0.6


def _micro_batch(vocab: int, lengths: tuple[int, ...] = LENGTHS):
    from train.batches import collate

    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate(lengths):
        prompt = 64
        rows.append({"prompt_ids": torch.randint(4, vocab, (prompt,), generator=g).tolist(),
                     "completion_ids": torch.randint(4, vocab, (n - prompt,), generator=g).tolist(),
                     "logprobs": (-torch.rand(n - prompt, generator=g) * 4).tolist(),
                     "advantage": 1.0 if i == 0 else -0.5})
    return collate(rows, pad_id=0)


class SavedBytes:
    """Bytes of the tensors autograd saves for backward (storages counted once), leaving out
    parameters (leaves that require grad): the activations a forward keeps."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        if not (t.requires_grad and t.grad_fn is None):
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


class GradientsSeen(torch.optim.SGD):
    """SGD that keeps the full gradients it stepped with (collective, like the step itself)."""

    def __init__(self, params):
        super().__init__(params, lr=1.0)
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure=None):
        self.grads = {id(p): _full(p.grad) for g in self.param_groups for p in g["params"]}
        return super().step(closure)


def worker(model: Path, out: Path, lengths: tuple[int, ...], runs: list[tuple[int, str]]) -> None:
    """For each (cp, cp_kind) of `runs`: a forward of two unpadded rows of lengths[0] tokens (saved
    bytes), logprobs and one SGD step on the right-padded rows of `lengths`, results under the
    tag cp{cp}{kind} (the kind left out for ulysses)."""
    from safetensors.torch import save_file

    from coordination.config import from_dict
    from train.build import load_model, make_trainable
    from train.config import TrainConfig
    from train.distributed import init_distributed, shutdown
    from train.step import StepSettings, train_step

    info = init_distributed(120.0)
    results = {}
    try:
        for cp, kind in runs:
            tag = f"cp{cp}" + ("" if kind == "ulysses" else kind)
            cfg = from_dict(TrainConfig, {"fused_lm_head_token_chunk_size": "disabled", "cp": cp, "cp_kind": kind})
            t = make_trainable(load_model(cfg, model, None), cfg, info)
            # Rows without padding: cp=1 then runs the same causal SDPA kernel as cp=2 does (with
            # padding, transformers' mask takes another kernel that keeps a [B, T, T] tensor per layer).
            full = _micro_batch(t.policy.lm.config.vocab_size, (lengths[0], lengths[0]))
            saved = SavedBytes()
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
                logp, _ = t.model(full.input_ids, full.attention_mask, full.targets)
            del logp
            mb = _micro_batch(t.policy.lm.config.vocab_size, lengths)
            with torch.no_grad():
                logp, _ = t.model(mb.input_ids, mb.attention_mask, mb.targets)
            save_file({"logp": logp.contiguous()}, str(out / f"{tag}-logp-{info.rank}.safetensors"))
            # Generation (SFT's evaluation) runs whole left-padded prompts on each rank: plain attention.
            prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
            generated = t.policy.generate(prompts, (prompts != 0).long(), max_new_tokens=6, pad_token_id=0,
                                          eos_token_id=2, synced=True)
            sgd = GradientsSeen(t.params)
            # cp=1: both ranks hold the micro-batch, two data ranks; cp=2: one data rank.
            tokens = mb.completion_tokens * (2 if cp == 1 else 1)
            metrics = train_step(t.model, t.params, sgd, [mb], global_completion_tokens=tokens, lr=1.0,
                                 settings=StepSettings(algorithm="grpo", backend="fsdp", dtype=torch.float32,
                                                       grad_clip=0.0), info=info)
            grads = {n: sgd.grads[id(p)] for n, p in t.policy.lm.named_parameters()}
            if info.is_main:
                save_file({n: g.contiguous() for n, g in grads.items()}, str(out / f"{tag}-grads.safetensors"))
            results[f"{tag}-{info.rank}"] = {"saved_bytes": saved.total, "loss": metrics.loss,
                                              "generated": generated.tolist(),
                                              "completion_tokens": metrics.completion_tokens,
                                              "tokens": metrics.tokens}
        ts.write_gathered(results, out, info)
    finally:
        shutdown()


def launch(root: Path, model: Path, lengths: tuple[int, ...], runs: list[tuple[int, str]]) -> tuple[Path, dict]:
    """The worker on 2 torchrun processes; returns its output folder and results."""
    out = root / "out"
    out.mkdir()
    codes = ts.torchrun("tests.test_context_parallel", [str(model), str(out), json.dumps(lengths), json.dumps(runs)],
                        root / "logs", nnodes=1, nproc_per_node=2)
    assert codes == [0], ts.logs_text(root / "logs")
    return out, json.loads((out / "results.json").read_text())


def assert_cp2_equals_cp1(model: Path, out: Path, results: dict, lengths: tuple[int, ...], tag: str) -> None:
    """Run `tag`'s logprobs, gradients, loss and token counts equal cp=1's within the tolerances."""
    from safetensors.torch import load_file

    seq = lengths[0]
    mb = _micro_batch(json.loads((model / "config.json").read_text())["vocab_size"], lengths)
    mask = mb.loss_mask.bool()
    ref = load_file(str(out / "cp1-logp-0.safetensors"))["logp"]
    assert torch.equal(ref, load_file(str(out / "cp1-logp-1.safetensors"))["logp"])
    halves = [load_file(str(out / f"{tag}-logp-{r}.safetensors"))["logp"] for r in range(2)]
    assert [h.shape for h in halves] == [(2, seq // 2)] * 2
    # The two slices cover positions 0..seq-1; position seq-1 predicts nothing and is dropped.
    gathered = torch.cat(halves, dim=1)[:, :seq - 1]
    worst = (gathered - ref)[mask].abs().max().item()
    assert worst <= LOGP_TOL, worst
    g1, g2 = load_file(str(out / "cp1-grads.safetensors")), load_file(str(out / f"{tag}-grads.safetensors"))
    assert g1.keys() == g2.keys() and len(g1) > 5
    for name in g1:
        scale = g1[name].abs().max().item()
        assert scale > 0, name
        assert (g1[name] - g2[name]).abs().max().item() <= GRAD_TOL * scale, name
    # Loss and counts are those of the one micro-batch, counted once under cp=2.
    assert results[f"{tag}-0"]["completion_tokens"] == mb.completion_tokens
    assert results["cp1-0"]["completion_tokens"] == 2 * mb.completion_tokens
    assert abs(results[f"{tag}-0"]["loss"] - results["cp1-0"]["loss"]) <= 1e-5 * abs(results["cp1-0"]["loss"])


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    model = ts.make_tiny(root / "tiny", layers=2, max_positions=SEQ)
    out, results = launch(root, model, LENGTHS, [(1, "ulysses"), (2, "ulysses"), (2, "ring")])
    return model, out, results


@pytest.mark.parametrize("tag", ["cp2", "cp2ring"])
def test_cp2_logprobs_and_gradients_equal_cp1_on_4k_token_rows(launched, tag):
    model, out, results = launched
    assert_cp2_equals_cp1(model, out, results, LENGTHS, tag)


@pytest.mark.parametrize("tag", ["cp2", "cp2ring"])
def test_generation_under_cp2_runs_whole_sequences_as_cp1_does(launched, tag):
    _, _, results = launched
    for rank in range(2):
        assert results[f"{tag}-{rank}"]["generated"] == results[f"cp1-{rank}"]["generated"]
    assert len(results["cp1-0"]["generated"][0]) > 5


@pytest.mark.parametrize("tag", ["cp2", "cp2ring"])
def test_cp2_saves_about_half_the_activation_bytes_per_rank(launched, tag):
    _, _, results = launched
    for rank in range(2):
        ratio = results[f"{tag}-{rank}"]["saved_bytes"] / results[f"cp1-{rank}"]["saved_bytes"]
        assert 0.3 < ratio <= SAVED_RATIO_MAX, (rank, ratio)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), Path(sys.argv[2]), tuple(json.loads(sys.argv[3])),
           [tuple(r) for r in json.loads(sys.argv[4])])
