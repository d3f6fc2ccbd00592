"""Serving LoRA adapters: the transformers engine's set_adapter against transformers + peft, and
what a checkpoint folder serves as (full weights, or a base model plus adapters)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordination.records import publish_record
from rollout.engine import EngineError, Sampling
from rollout.engines.transformers_engine import TransformersEngine
from coordination.checkpoints import TRAINER_STATE, CheckpointError, serving_weights
from train.tiny import write_tiny_model

TOLERANCE = 1e-4
TEXTS = ["3+4=", "12+30=", "user: hi\nassistant: ", "7"]
SAMPLED = Sampling(max_new_tokens=8, temperature=1.0, seed=7)
GREEDY = Sampling(max_new_tokens=8, temperature=0.0, stop_at_eos=False)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_adapter(base: Path, out: Path, *, rank: int, seed: int) -> Path:
    """A peft LoRA adapter of `base` with random (non-zero) B matrices, saved as the trainer saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2.0 * rank, bias="none",
                                                  target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    peft_model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    base = write_tiny_model(root / "base", layers=2, seed=1)
    return {"base": base, "a1": make_adapter(base, root / "a1", rank=4, seed=1),
            "a2": make_adapter(base, root / "a2", rank=4, seed=2), "root": root}


@pytest.fixture(scope="module")
def peft_reference(models):
    """log_softmax(logits / T) of completion tokens under transformers + peft (adapter unmerged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = {}

    def logprobs(adapter: Path | None, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
        if adapter not in loaded:
            model = AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.float32)
            loaded[adapter] = (PeftModel.from_pretrained(model, str(adapter)) if adapter else model).eval()
        with torch.no_grad():
            logits = loaded[adapter](torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits / temperature if temperature else logits, -1)
        return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()

    return logprobs


@pytest.fixture(scope="module")
def merged_folder(models):
    """adapter a1 merged into the base by peft and saved as a full Hugging Face folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models["root"] / "merged-a1"
    model = AutoModelForCausalLM.from_pretrained(models["base"], dtype=torch.float32)
    PeftModel.from_pretrained(model, str(models["a1"])).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(models["base"]).save_pretrained(out)
    return out


@pytest.fixture
def engine(models):
    eng = TransformersEngine(max_batch_sequences=16)
    eng.start(models["base"])
    yield eng
    eng.stop()


def _prompts(engine) -> list[list[int]]:
    return [engine.tokenizer(t)["input_ids"] for t in TEXTS]


def _tokens(out) -> list[list[list[int]]]:
    return [[s.token_ids for s in group] for group in out]


def _worst(out, prompts, reference, adapter, temperature) -> float:
    return max(abs(a - b) for prompt, group in zip(prompts, out) for s in group
               for a, b in zip(s.logprobs, reference(adapter, prompt, s.token_ids, temperature)))


def test_set_adapter_samples_like_a_peft_merged_model(engine, models, peft_reference, merged_folder):
    prompts = _prompts(engine)
    base_out = engine.generate(prompts, 3, SAMPLED)
    engine.set_adapter(models["a1"])
    assert engine.adapter_dir == models["a1"].resolve() and engine.model_dir == models["base"]
    adapted = engine.generate(prompts, 3, SAMPLED)
    assert _tokens(adapted) != _tokens(base_out)                  # the adapter changes what is sampled
    assert _worst(adapted, prompts, peft_reference, models["a1"], 1.0) < TOLERANCE
    with TransformersEngine(max_batch_sequences=16) as merged:    # peft's own merge, as a full checkpoint
        merged.start(merged_folder)
        same_call = merged.generate(prompts, 3, SAMPLED)
    assert _tokens(adapted) == _tokens(same_call)
    assert max(abs(a - b) for g, h in zip(adapted, same_call) for s, t in zip(g, h)
               for a, b in zip(s.logprobs, t.logprobs)) < TOLERANCE


def test_next_adapter_replaces_the_last_and_none_restores_the_base(engine, models, peft_reference):
    prompts = _prompts(engine)
    base_greedy = engine.generate(prompts, 1, GREEDY)
    engine.set_adapter(models["a1"])
    first = engine.generate(prompts, 1, GREEDY)
    engine.set_adapter(models["a2"])                              # merged into fresh base weights, not onto a1
    second = engine.generate(prompts, 1, GREEDY)
    assert _tokens(second) != _tokens(first)
    assert _worst(second, prompts, peft_reference, models["a2"], 0.0) < TOLERANCE
    engine.set_adapter(None)
    assert engine.adapter_dir is None
    again = engine.generate(prompts, 1, GREEDY)
    assert _tokens(again) == _tokens(base_greedy)
    assert _worst(again, prompts, peft_reference, None, 0.0) < TOLERANCE


def test_reload_and_restart_serve_the_weights_alone(engine, models):
    engine.set_adapter(models["a1"])
    engine.reload(models["base"])
    assert engine.adapter_dir is None
    engine.set_adapter(models["a1"])
    engine.stop()
    assert engine.adapter_dir is None


def test_set_adapter_refusals_name_the_problem(models, tmp_path):
    idle = TransformersEngine()
    with pytest.raises(EngineError, match="not started"):
        idle.set_adapter(models["a1"])
    other = write_tiny_model(tmp_path / "other", hidden=64, heads=2, kv_heads=1, layers=2)
    misfit = make_adapter(other, tmp_path / "misfit", rank=4, seed=0)
    with TransformersEngine() as engine:
        engine.start(models["base"])
        with pytest.raises(EngineError, match="not a LoRA adapter folder"):
            engine.set_adapter(models["base"])
        with pytest.raises(EngineError, match="trained on this base model|does not fit"):
            engine.set_adapter(misfit)
        assert engine.adapter_dir is None                          # a refused adapter leaves the base served
        engine.set_adapter(models["a1"])
        assert engine.adapter_dir == models["a1"].resolve()


def _trainer_state(folder: Path, lora: dict | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    publish_record(folder / TRAINER_STATE, "trainer-state", {"iteration": 1, "lora": lora}, run_id="r", generation=0)


def test_adapters_only_checkpoint_serves_its_base_plus_adapter(models, tmp_path):
    folder = tmp_path / "iter-1"
    _trainer_state(folder, {"rank": 4, "publish": "adapters", "base": str(models["base"])})
    (folder / "adapter").mkdir()
    assert serving_weights(folder) == (models["base"], folder / "adapter")


def test_full_weights_folders_serve_as_they_are(models, tmp_path):
    assert serving_weights(models["base"]) == (models["base"], None)      # a base model: no trainer state
    merged = tmp_path / "iter-2"                                          # lora.publish=merged: adapter/ too
    _trainer_state(merged, {"rank": 4, "publish": "merged", "base": str(models["base"])})
    (merged / "config.json").write_text("{}")
    (merged / "adapter").mkdir()
    assert serving_weights(merged) == (merged, None)
    full = tmp_path / "iter-3"                                            # full training, no LoRA
    _trainer_state(full, None)
    (full / "config.json").write_text("{}")
    assert serving_weights(full) == (full, None)


def test_adapters_only_checkpoint_without_its_base_is_refused(tmp_path):
    folder = tmp_path / "iter-1"
    _trainer_state(folder, {"rank": 4, "publish": "adapters", "base": str(tmp_path / "gone")})
    with pytest.raises(CheckpointError, match="which is gone; restore it"):
        serving_weights(folder)
    nothing = tmp_path / "iter-2"
    _trainer_state(nothing, None)
    with pytest.raises(CheckpointError, match="neither full weights"):
        serving_weights(nothing)
    damaged = tmp_path / "iter-3"
    damaged.mkdir()
    (damaged / TRAINER_STATE).write_text('{"kind": "trainer-state", "data": {"lora"')
    with pytest.raises(CheckpointError, match="is damaged"):
        serving_weights(damaged)
