"""The `tasks.judge` config section: the LLM judge that scores whole episodes (docs/design.md §7).

The judge runs either as a second engine on the node, started and stopped by baton around each
rollout phase (`model` is its Hugging Face folder, `engine` its kind), or behind an
OpenAI-compatible URL (`url`, `model` the name sent, the key from `api_key` = env:NAME or
file:PATH, never the key itself).
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from coordination.config import ConfigError, check_secret_reference, is_secret_reference, option, positive

FIELDS = ("task", "trajectory", "answer")  # what a template may name
PARSERS = ("last_number",)


def template_fields(template: str) -> list[str]:
    """The fields `template` names, or ConfigError saying what is wrong with it."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"judge.template is not a valid template ({exc}); write fields as {{task}}, {{trajectory}}, "
                          f"{{answer}} and a literal brace as {{{{ or }}}}") from None
    bad = [n for n in names if n not in FIELDS]
    if bad:
        raise ConfigError(f"judge.template names {{{bad[0]}}}, which is not a field; the fields are "
                          f"{', '.join('{' + f + '}' for f in FIELDS)} (a literal brace is {{{{ or }}}})")
    return names


@dataclass
class JudgeConfig:
    """An LLM judge scoring each episode (its 'judge' reward part); off while `template` is empty."""

    template: str = option(
        "", "prompt sent to the judge, with fields {task} (the task's prompt), {trajectory} (every message of the "
            "episode as 'role: content' lines) and {answer} (the last policy turn); empty = no judge")
    model: str = option(
        "", "without url: the judge model's Hugging Face folder, served by a second engine on each node for the "
            "rollout phase; with url: the model name sent in each request")
    url: str = option(
        "", "base URL of an OpenAI-compatible server (e.g. http://judge.example:8000/v1); requests go to "
            "URL/chat/completions. Empty = a second engine on the node")
    api_key: str = option(
        "", "key for url, as env:NAME (environment variable NAME) or file:PATH (the file's content); never the key "
            "itself, which would be written to config.yaml. Sent as 'Authorization: Bearer', never logged")
    engine: Literal["transformers", "vllm"] = option(
        "transformers", "the second engine's kind (without url); it takes the inference section's settings with its "
                        "own port, served name 'judge' and judge.gpu_memory_utilization")
    gpu_memory_utilization: float = option(
        0.2, "fraction of each GPU the judge's vLLM server may use; with a vLLM policy on the same GPUs the two "
             "fractions together must stay within 1 (checked at the start)")
    parser: str = option(
        "last_number", "turns the judge's answer into a score: 'last_number' (the answer's last number) or "
                       "'package.module:function' taking the answer text and returning a number")
    min_score: float = option(0.0, "a score below this is raised to it")
    max_score: float = option(1.0, "a score above this is lowered to it")
    max_new_tokens: int = option(64, "most tokens of one judge answer")
    temperature: float = option(0.0, "judge sampling temperature (0 = greedy)")
    batch_size: int = option(16, "episodes judged at once: prompts per engine call, or requests in flight to url")
    attempts: int = option(
        3, "tries per episode: a call that fails (HTTP error, no answer within timeout, an answer without a score) "
           "is tried again up to this many times in all; then the episode ends as judge_error")
    timeout: float = option(60.0, "seconds one judge call (one request, or one engine call of a batch) may take")

    @property
    def enabled(self) -> bool:
        return bool(self.template)

    def __post_init__(self) -> None:
        for key in ("max_new_tokens", "batch_size", "attempts", "timeout"):
            positive(getattr(self, key), key)
        if self.temperature < 0:
            raise ConfigError(f"judge.temperature must be zero or positive (got {self.temperature})")
        if not self.min_score < self.max_score:
            raise ConfigError(f"judge.min_score={self.min_score} must be below judge.max_score={self.max_score}")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ConfigError(f"judge.gpu_memory_utilization must be in (0, 1) (got {self.gpu_memory_utilization})")
        if self.parser not in PARSERS and ":" not in self.parser:
            raise ConfigError(f"judge.parser={self.parser!r} is neither 'last_number' nor 'package.module:function'")
        if self.api_key:
            if not is_secret_reference(self.api_key):
                raise ConfigError("judge.api_key must be env:NAME or file:PATH, not the key itself (it would be written "
                                  "to config.yaml and claims); export the key and give env:NAME (the value given is "
                                  "not shown)")
            check_secret_reference(self.api_key, "judge.api_key")
        if self.url:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"judge.url={self.url!r} is not an http(s) URL with a host; give the server's base "
                                  f"URL, e.g. http://127.0.0.1:8000/v1")
        if not self.enabled:
            return
        if not {"trajectory", "answer"} & set(template_fields(self.template)):
            raise ConfigError("judge.template names neither {trajectory} nor {answer}: the judge would never see the "
                              "episode; add one of them")
        if not self.model:
            raise ConfigError("judge.model is empty: give the judge model's folder (a second engine on the node) or, "
                              "with judge.url, the model name the server serves")
