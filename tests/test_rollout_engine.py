"""The transformers engine on the tiny model: logprobs, EOS masking, seeding, padding."""
from __future__ import annotations

import pytest
import torch

from rollout.engine import EngineError, Sampling
from rollout.engines.transformers_engine import TransformersEngine
from train.tiny import write_tiny_model

EOS = 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    eng = TransformersEngine(max_batch_sequences=16)
    eng.start(model_dir)
    yield eng
    eng.stop()


def prompt_ids(engine, texts):
    return [engine.tokenizer(t)["input_ids"] for t in texts]


def recomputed_logprobs(engine, prompt, completion, temperature):
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + completion])).logits[0].float()
    scaled = logits / temperature if temperature > 0 else logits
    logp = torch.log_softmax(scaled, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_sampling_logprobs_equal_a_forward_recomputation(engine, temperature, top_p):
    # Prompts of different lengths share a left-padded batch; each is recomputed alone.
    prompts = prompt_ids(engine, ["1+2=", "123+456=", "99-1=", "7*8="])
    out = engine.generate(prompts, 5, Sampling(max_new_tokens=24, temperature=temperature, top_p=top_p, seed=11))
    checked = 0
    for prompt, group in zip(prompts, out):
        assert len(group) == 5
        for s in group:
            expect = recomputed_logprobs(engine, prompt, s.token_ids, temperature)
            assert len(s.logprobs) == len(s.token_ids) >= 1
            assert max(abs(a - b) for a, b in zip(s.logprobs, expect)) < 1e-4
            checked += len(s.token_ids)
    assert checked > 20


def test_completion_ends_at_first_eos_and_nothing_after_it(engine):
    prompts = prompt_ids(engine, ["1+1=", "5-3=", "12*3="])
    out = engine.generate(prompts, 16, Sampling(max_new_tokens=40, temperature=1.0, seed=5))
    samples = [s for g in out for s in g]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "the random tiny model samples EOS often; none in 48 samples of 40 tokens means no masking"
    for s in samples:
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == EOS and EOS not in s.token_ids[:-1]
            assert len(s.token_ids) <= 40
        else:
            assert EOS not in s.token_ids and len(s.token_ids) == 40
        assert "<eos>" not in s.text and "<pad>" not in s.text
        assert s.text == engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
    assert any(len(s.token_ids) < 40 for s in stopped)


def test_ignoring_eos_gives_fixed_lengths(engine):
    out = engine.generate(prompt_ids(engine, ["1+1=", "22+22="]), 8,
                          Sampling(max_new_tokens=30, temperature=1.0, seed=2, stop_at_eos=False))
    assert {len(s.token_ids) for g in out for s in g} == {30}
    assert {s.finish_reason for g in out for s in g} == {"length"}


def test_same_seed_reproduces_samples_and_other_seed_differs(engine):
    prompts = prompt_ids(engine, ["3+4=", "10-2="])
    a = engine.generate(prompts, 4, Sampling(max_new_tokens=12, seed=42))
    b = engine.generate(prompts, 4, Sampling(max_new_tokens=12, seed=42))
    c = engine.generate(prompts, 4, Sampling(max_new_tokens=12, seed=43))
    ids = lambda out: [[s.token_ids for s in g] for g in out]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_greedy_output_does_not_depend_on_batch_padding(engine):
    short, long = prompt_ids(engine, ["1=", "123456+654321="])
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    alone = engine.generate([short], 1, greedy)[0][0]
    batched = engine.generate([long, short], 1, greedy)[1][0]
    assert alone.token_ids == batched.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs)) < 1e-4


def test_prompt_longer_than_the_model_is_refused(engine):
    with pytest.raises(EngineError, match=r"exceeds the model's 256 positions"):
        engine.generate([[1] * 250], 1, Sampling(max_new_tokens=8))


def test_lifecycle_reload_and_sleep_wake(engine, tmp_path):
    other = write_tiny_model(tmp_path / "other", seed=1)
    eng = TransformersEngine()
    with pytest.raises(EngineError, match="not started"):
        eng.generate([[1, 5]], 1, Sampling(max_new_tokens=2))
    eng.start(engine.model_dir)
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    first = eng.generate([[1, 20, 21]], 1, greedy)[0][0]
    eng.reload(other)
    assert eng.model_dir == other
    second = eng.generate([[1, 20, 21]], 1, greedy)[0][0]
    assert first.logprobs != second.logprobs
    eng.sleep()
    assert not eng.running and eng.model is None
    eng.wake(engine.model_dir)
    assert eng.generate([[1, 20, 21]], 1, greedy)[0][0].token_ids == first.token_ids
    assert eng.stats.requests == 3 and eng.stats.samples == 3
    eng.stop()
    eng.stop()
    assert not eng.running
    with pytest.raises(EngineError, match="not a Hugging Face model folder"):
        eng.start(tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the allocator cache exists only there")
def test_stop_on_cuda_returns_the_engines_memory_to_the_driver(tmp_path):
    # The trainer of phase 10 runs on the same GPU next; memory the caching allocator still
    # reserves for the stopped engine would be out of its reach.
    model_dir = write_tiny_model(tmp_path / "model")
    eng = TransformersEngine(device="cuda", dtype="float32", max_batch_sequences=16)
    eng.start(model_dir)
    ids = eng.tokenizer("1+2=")["input_ids"]
    eng.generate([ids], 4, Sampling(max_new_tokens=8, temperature=1.0, seed=0))
    reserved = torch.cuda.memory_reserved()
    assert reserved > 0
    eng.stop()
    assert torch.cuda.memory_reserved() < reserved / 2  # without empty_cache it stays reserved
