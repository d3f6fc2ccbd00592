"""The inference engine interface (docs/design.md §2).

An engine turns prompt token ids into sampled completions with per-token sampling logprobs.
Two implementations share this interface: the in-process transformers engine (CPU runs, tests,
demo) and the vLLM engine (an OpenAI-compatible server subprocess). The rollout worker only
sees this interface.

Logprob convention: `Sample.logprobs[i]` is the log-probability of `token_ids[i]` under the
distribution the token was sampled from after temperature scaling (logits / temperature), so
the trainer recomputes the same quantity with `log_softmax(logits / temperature)`. With
temperature 0 (greedy), it is the log-probability under the unscaled distribution.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Sampling:
    """How to sample. temperature 0 means greedy."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # Stop at EOS (finish_reason "stop"); False samples exactly max_new_tokens (benchmarks).
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Sample:
    """One completion. `token_ids` include the EOS token when the model stopped (finish_reason
    "stop"), so training teaches the model to stop; `text` is decoded without special tokens."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} logprobs")


@dataclass
class EngineStats:
    """Counters an engine keeps for throughput reports."""

    requests: int = 0
    samples: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class EngineError(RuntimeError):
    """The engine failed to start, serve or stop; the message says what to check."""


class Engine(abc.ABC):
    """Lifecycle: start(model_dir) -> [set_adapter(adapter_dir)] -> generate(...)* ->
    [reload(other_dir) | sleep()/wake(dir)] -> [set_adapter(...)] -> ... -> stop().

    `model_dir` is a Hugging Face folder with full weights. A LoRA run that publishes adapters
    only (train.lora.publish=adapters) is served as its frozen base model plus an adapter:
    start(base), then set_adapter(checkpoint/adapter); each later iteration swaps the adapter
    with set_adapter, without a restart. start, reload and wake serve the weights of their folder
    alone (`adapter_dir` is None afterwards): call set_adapter again after them.
    """

    name: str = "engine"
    #: True when generate() keeps a rolling window of requests in flight and takes `on_result`
    #: (index, samples) to hand over each prompt's samples as they finish; the worker then gives it
    #: all of a rank's tasks in one call. Engines that batch in their own process (transformers)
    #: get `rollout.prompts_per_call` prompts per call instead.
    rolling: bool = False

    def __init__(self) -> None:
        self.model_dir: Path | None = None
        self.adapter_dir: Path | None = None  # LoRA adapter served on top of model_dir, if any
        self.stats = EngineStats()

    @abc.abstractmethod
    def start(self, model_dir: Path) -> None:
        """Load `model_dir` (a Hugging Face folder) and become ready to generate."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Release everything the engine holds (processes, memory). Idempotent."""

    @abc.abstractmethod
    def reload(self, model_dir: Path) -> None:
        """Serve the weights of `model_dir` without a full restart where possible."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]:
        """`n` samples for each prompt: result[i][j] is sample j of prompts[i]."""

    def set_adapter(self, adapter_dir: Path | None) -> None:
        """Serve the LoRA adapter in `adapter_dir` (peft format, trained on the weights of
        `model_dir`) on top of those weights, replacing the adapter served before; None serves the
        weights alone. The engine must be started. Engines without LoRA support accept only None."""
        if adapter_dir is None and self.adapter_dir is None:
            return
        raise EngineError(f"the {self.name} engine cannot serve LoRA adapters ({adapter_dir}); use the transformers "
                          f"or vllm engine, or publish merged checkpoints (train.lora.publish=merged)")

    def sleep(self, *, new_weights: bool = False) -> None:
        """Free the accelerator between rollouts while keeping the engine's process (default: stop).
        `new_weights`: the next wake serves other weights, so the current ones need not be kept."""
        self.stop()

    def wake(self, model_dir: Path) -> None:
        """Undo `sleep()` and serve `model_dir` (default: start)."""
        self.start(model_dir)

    @property
    def running(self) -> bool:
        return self.model_dir is not None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
