"""How a task becomes prompt token ids. Rollouts and SFT both use this, so a model warm-started
by SFT sees exactly the prompts it is later sampled on."""
from __future__ import annotations

from typing import Any, Mapping


def encode_prompt(tokenizer: Any, task: Mapping[str, Any]) -> list[int]:
    """Token ids of a task's prompt.

    Chat tasks (`messages`: a list of {role, content}) go through the tokenizer's chat template
    with the generation prompt appended; plain tasks (`prompt`: text) are tokenized with the
    tokenizer's special tokens (a BOS where the tokenizer adds one)."""
    messages = task.get("messages")
    if messages:
        enc = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(task["prompt"], add_special_tokens=True)["input_ids"]]
