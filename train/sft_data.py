"""SFT examples from JSONL: each line becomes (prompt token ids, completion token ids).

Accepted shapes, one per line:
- a baton task `{"id", "prompt", "answer"}`: the answer is the completion;
- `{"prompt", "completion"}`;
- chat `{"messages": [...]}` ending with an assistant message. Every assistant message is a
  turn the model learns (a worked episode of an environment has several, rollout/envs/worked.py);
  the other messages are context. The tokens are laid out as an episode's are
  (rollout/episodes.py): the template's ids of the messages before the first assistant turn
  (with the generation prompt), each turn's ids followed by EOS, and between turns the
  template's ids of the messages in between (`ObservationTokens`), so a model warm-started on
  worked episodes sees the very token sequences it is later sampled on.
Prompts are encoded with rollout.prompts.encode_prompt, exactly as rollouts encode them, and
every completion ends with EOS so the model learns to stop. Loss falls on the model's turns only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.prompts import ObservationTokens, chat_ids, encode_prompt


class SFTDataError(ValueError):
    """A line that is not an SFT example; the message names file, line and the accepted shapes."""


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int] | None = None  # over completion_ids: 1 on the model's turns; None: all of them

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def trained_tokens(self) -> int:
        return len(self.completion_ids) if self.loss_mask is None else sum(self.loss_mask)


_SHAPES = ('{"prompt", "answer"} (a baton task), {"prompt", "completion"}, or {"messages": [...]} '
           'ending with an assistant message')


def _messages(obj: dict) -> list[dict[str, str]]:
    messages = obj["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                  and isinstance(m.get("role"), str) for m in messages):
        raise ValueError("'messages' must be a list of {\"role\", \"content\"} objects with string values")
    if messages[-1]["role"] != "assistant" or messages[0]["role"] == "assistant":
        raise ValueError("the last message must be the assistant's reply (the completion), and the first one "
                         "another role's (the prompt)")
    return messages


class _Turns:
    """Chat examples as token ids laid out like an episode (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.observation = tokenizer, None

    def __call__(self, messages: list[dict[str, str]]) -> Example:
        eos = int(self.tokenizer.eos_token_id)
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ids: list[int] = []
        mask: list[int] = []
        context: list[dict[str, str]] = []
        for m in messages[first:]:
            if m["role"] != "assistant":
                context.append(m)
                continue
            if ids:  # the template's ids after the previous turn, up to this turn's generation prompt
                if self.observation is None:
                    self.observation = ObservationTokens(self.tokenizer)
                between = self.observation(context)
                ids += between
                mask += [0] * len(between)
            turn = [int(i) for i in self.tokenizer(m["content"], add_special_tokens=False)["input_ids"]] + [eos]
            ids += turn
            mask += [1] * len(turn)
            context = []
        return Example(chat_ids(self.tokenizer, messages[:first], add_generation_prompt=True), ids, mask)


def _split(obj: Any) -> tuple[dict[str, Any], str]:
    """(prompt part as a task mapping for encode_prompt, completion text) of a prompt line."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, found {type(obj).__name__}")
    for key in ("completion", "answer"):
        if key in obj and "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError("'prompt' must be a non-empty string")
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise ValueError(f"{key!r} must be a string or a number")
            return {"prompt": obj["prompt"]}, value if isinstance(value, str) else json.dumps(value)
    raise ValueError(f"unknown shape with keys {sorted(obj)}")


def load_examples(path: Path, tokenizer: Any) -> list[Example]:
    path = Path(path)
    if tokenizer.eos_token_id is None:
        raise SFTDataError("the tokenizer has no EOS token; SFT appends one to every completion")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise SFTDataError(f"SFT data file {path} does not exist") from None
    examples = []
    turns = _Turns(tokenizer)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and obj.get("messages"):
                examples.append(turns(_messages(obj)))
                continue
            prompt, completion = _split(obj)
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:
            raise SFTDataError(f"{path}:{lineno}: {exc}; accepted lines are {_SHAPES}") from None
        completion_ids = [int(i) for i in tokenizer(completion, add_special_tokens=False)["input_ids"]]
        examples.append(Example(encode_prompt(tokenizer, prompt), completion_ids + [int(tokenizer.eos_token_id)]))
    if not examples:
        raise SFTDataError(f"SFT data file {path} holds no examples")
    return examples
