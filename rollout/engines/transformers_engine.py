"""The in-process transformers engine: CPU runs, tests and the demo.

Sampling is our own short decode loop over a KV cache rather than `model.generate`, so that
(1) the logprob of every sampled token is exactly `log_softmax(logits / temperature)` of the
forward pass that chose it (the convention in rollout/engine.py, which the trainer recomputes),
(2) each call draws from its own `torch.Generator` seeded from `Sampling.seed`, leaving the
process-wide RNG alone and making a rerun with the same inputs reproduce the same samples, and
(3) a sequence is finished at its first EOS: nothing after it is kept (a random tiny model
samples EOS, pad and BOS anywhere).

Prompts of different lengths are left-padded; position ids come from the attention mask, so a
padded prompt sees the same positions as it would alone.

A LoRA adapter (`set_adapter`) is merged with peft into a freshly loaded copy of the base
weights, so sampling with an adapter costs what it costs without one.
"""
from __future__ import annotations

import gc
import os
import time
import warnings
from pathlib import Path
from typing import Any

from rollout.adapter import WEIGHTS_FILE, read_adapter
from rollout.engine import Engine, EngineError, Sample, Sampling

_DTYPES = ("float32", "bfloat16", "float16")


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, *, device: str = "cpu", dtype: str = "float32", max_batch_sequences: int = 256,
                 threads: int | None = None, attn_implementation: str | None = None):
        super().__init__()
        if dtype not in _DTYPES:
            raise EngineError(f"transformers engine dtype must be one of {', '.join(_DTYPES)} (got {dtype!r})")
        if max_batch_sequences < 1:
            raise EngineError(f"max_batch_sequences must be at least 1 (got {max_batch_sequences})")
        self.device = device
        self.dtype = dtype
        self.max_batch_sequences = max_batch_sequences
        self.threads = threads
        self.attn_implementation = attn_implementation
        self.model: Any = None
        self.tokenizer: Any = None
        self.eos_ids: frozenset[int] = frozenset()
        self.pad_id = 0
        self.max_positions: int | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        model = self._load_weights(model_dir)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise EngineError(f"transformers engine cannot load the tokenizer of {model_dir}: {exc}") from exc
        self.serve(model, tokenizer, model_dir)

    def serve(self, model: Any, tokenizer: Any, model_dir: Path | None = None) -> None:
        """Sample from a model already in memory (SFT's episode eval samples the weights it trains)."""
        self.model, self.tokenizer = model.eval(), tokenizer
        self.eos_ids = frozenset(self._eos_ids(model, tokenizer))
        if not self.eos_ids:
            raise EngineError(f"{model_dir or 'the model'} defines no eos_token_id (config, generation config or tokenizer); "
                              f"the engine cannot tell when a completion stops")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.pad_id = int(pad)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.model_dir = model_dir
        self.adapter_dir = None

    def _load_weights(self, model_dir: Path) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        if not (model_dir / "config.json").is_file():
            raise EngineError(f"{model_dir} is not a Hugging Face model folder (no config.json); "
                              f"point the engine at a checkpoint folder")
        if self.threads:
            torch.set_num_threads(self.threads)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, self.dtype)}
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(self.device)
        except (OSError, ValueError) as exc:
            raise EngineError(f"transformers engine cannot load {model_dir}: {exc}") from exc
        return model.eval()

    def set_adapter(self, adapter_dir: Path | None) -> None:
        """Merge the adapter into a fresh copy of the base weights, so sampling costs what it costs
        without LoRA; merging into the weights being served would stack one adapter on another."""
        if self.model is None or self.model_dir is None:
            raise EngineError("transformers engine is not started; call start(base_model_dir) before set_adapter")
        adapter = read_adapter(adapter_dir) if adapter_dir is not None else None
        path = adapter.path if adapter is not None else None
        if path == self.adapter_dir:
            return  # checkpoint folders are immutable: the same path holds the same adapter
        model = self._load_weights(self.model_dir)
        if adapter is not None:
            model = merge_adapter(model, adapter.path, self.model_dir)
        self.model = model
        self.adapter_dir = path

    @staticmethod
    def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        return ids

    def stop(self) -> None:
        self.model = None
        self.tokenizer = None
        self.model_dir = None
        self.adapter_dir = None
        self._release_device_memory()

    @staticmethod
    def _release_device_memory() -> None:
        """Hand the freed weights and KV tensors back to the driver: PyTorch's caching allocator
        keeps them reserved otherwise, and the trainer that runs next on the same GPU (phase 10)
        could not use them. Collect first: a model can sit in reference cycles."""
        import torch

        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()

    def reload(self, model_dir: Path) -> None:
        # In-process weights are cheap to load; a fresh load also picks up a changed tokenizer.
        self.stop()
        self.start(model_dir)

    # -- sampling ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]:
        import torch

        if self.model is None:
            raise EngineError("transformers engine is not started; call start(model_dir) first")
        if n < 1:
            raise EngineError(f"n must be at least 1 (got {n})")
        for i, p in enumerate(prompts):
            if not p:
                raise EngineError(f"prompt {i} is empty; every prompt needs at least one token")
            if self.max_positions and len(p) + sampling.max_new_tokens > self.max_positions:
                raise EngineError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} it exceeds the "
                    f"model's {self.max_positions} positions; shorten the prompt or lower rollout.max_new_tokens")
        t0 = time.perf_counter()
        generator = torch.Generator(device=self.device)
        # An unseeded call draws its seed from the OS, leaving torch's global RNG untouched.
        generator.manual_seed(sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        flat = [p for p in prompts for _ in range(n)]
        samples: list[Sample] = []
        for start in range(0, len(flat), self.max_batch_sequences):
            samples.extend(self._generate_batch(flat[start:start + self.max_batch_sequences], sampling, generator))
        self.stats.requests += 1
        self.stats.samples += len(samples)
        self.stats.completion_tokens += sum(len(s.token_ids) for s in samples)
        self.stats.seconds += time.perf_counter() - t0
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling, generator: Any) -> list[Sample]:
        import torch

        device = self.device
        batch, width = len(prompts), max(len(p) for p in prompts)
        # Built on the CPU, then moved in one transfer each.
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)

        tokens = torch.full((batch, sampling.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, sampling.max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
            for step in range(sampling.max_new_tokens):
                logits = out.logits[:, -1, :].float()
                token, logprob = self._pick(logits, sampling, generator)
                live = ~finished
                tokens[live, step] = token[live]
                logprobs[live, step] = logprob[live]
                lengths += live.long()
                if sampling.stop_at_eos:
                    hit = live & torch.isin(token, eos)
                    stopped |= hit
                    finished |= hit
                if bool(finished.all()) or step + 1 == sampling.max_new_tokens:
                    break
                mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
                positions = positions[:, -1:] + 1
                out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                                 past_key_values=out.past_key_values, use_cache=True)
        tokens, logprobs, lengths, stopped = tokens.tolist(), logprobs.tolist(), lengths.tolist(), stopped.tolist()
        samples = []
        for i in range(batch):
            ids = tokens[i][:lengths[i]]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            samples.append(Sample(token_ids=ids, logprobs=logprobs[i][:lengths[i]], text=text,
                                  finish_reason="stop" if stopped[i] else "length"))
        return samples

    @staticmethod
    def _pick(logits: Any, sampling: Sampling, generator: Any) -> tuple[Any, Any]:
        """Next token of every row and its logprob under log_softmax(logits / temperature)."""
        import torch

        if sampling.greedy:
            logp = torch.log_softmax(logits, dim=-1)
            token = logits.argmax(dim=-1)
            return token, logp.gather(-1, token[:, None]).squeeze(-1)
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        probs = logp.exp()
        if sampling.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= sampling.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)


def merge_adapter(model: Any, adapter_dir: Path, base_dir: Path) -> Any:
    """`model` with the peft LoRA adapter in `adapter_dir` merged into its weights (in place)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        config = LoraConfig.from_pretrained(str(adapter_dir))
        config.inference_mode = True
        with warnings.catch_warnings():  # peft calls a transformers property that transformers 5 deprecates
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = get_peft_model(model, config)
        result = set_peft_model_state_dict(peft_model, load_file(str(adapter_dir / WEIGHTS_FILE)))
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise EngineError(f"cannot apply the LoRA adapter {adapter_dir} to {base_dir}: {exc}; the adapter must "
                          f"have been trained on this base model") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise EngineError(f"the LoRA adapter {adapter_dir} does not fit {base_dir} (missing {missing[:3]}, "
                          f"unexpected {list(result.unexpected_keys)[:3]}); serve it on the base model it was "
                          f"trained on (trainer_state.json, lora.base)")
    return peft_model.merge_and_unload().eval()
