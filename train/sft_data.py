"""SFT examples from JSONL: each line becomes (prompt token ids, completion token ids).

Accepted shapes, one per line:
- a baton task `{"id", "prompt", "answer"}`: the answer is the completion;
- `{"prompt", "completion"}`;
- chat `{"messages": [...]}` whose last message is the assistant's reply: the earlier messages
  go through the chat template (with the generation prompt), the last content is the completion.
Prompts are encoded with rollout.prompts.encode_prompt, exactly as rollouts encode them, and
every completion ends with EOS so the model learns to stop. Loss falls on completion tokens only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.prompts import encode_prompt


class SFTDataError(ValueError):
    """A line that is not an SFT example; the message names file, line and the accepted shapes."""


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    completion_ids: list[int]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


_SHAPES = ('{"prompt", "answer"} (a baton task), {"prompt", "completion"}, or {"messages": [...]} '
           'ending with an assistant message')


def _split(obj: Any) -> tuple[dict[str, Any], str]:
    """(prompt part as a task mapping for encode_prompt, completion text)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, found {type(obj).__name__}")
    if obj.get("messages"):
        messages = obj["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                      and isinstance(m.get("role"), str) for m in messages):
            raise ValueError("'messages' must be a list of {\"role\", \"content\"} objects with string values")
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise ValueError("the last message must be the assistant's reply (the completion), after at least one "
                             "other message")
        return {"messages": messages[:-1]}, messages[-1]["content"]
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
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt, completion = _split(json.loads(line))
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:
            raise SFTDataError(f"{path}:{lineno}: {exc}; accepted lines are {_SHAPES}") from None
        completion_ids = [int(i) for i in tokenizer(completion, add_special_tokens=False)["input_ids"]]
        examples.append(Example(encode_prompt(tokenizer, prompt), completion_ids + [int(tokenizer.eos_token_id)]))
    if not examples:
        raise SFTDataError(f"SFT data file {path} holds no examples")
    return examples
