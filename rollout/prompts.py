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


def chat_ids(tokenizer: Any, messages: list, *, add_generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no chat template; environment episodes "
                         f"render their messages with it: use a chat model or set tokenizer.chat_template")
    enc = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    return [int(i) for i in ids]


class ObservationTokens:
    """Template token ids of the messages an environment adds after an assistant turn.

    Only the new messages are rendered, never the conversation so far: the episode's earlier
    tokens are the ones the engine sampled, and re-tokenizing their text could give other ids.
    The template is applied to a fixed two-message conversation with and without the new
    messages appended; the difference is what the template puts between an assistant turn and
    the next generation (the new messages and the generation prompt)."""

    _BASE = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.base = chat_ids(tokenizer, self._BASE, add_generation_prompt=False)

    def __call__(self, messages: list) -> list[int]:
        full = chat_ids(self.tokenizer, self._BASE + list(messages), add_generation_prompt=True)
        if full[:len(self.base)] != self.base:
            raise ValueError(f"the chat template of {type(self.tokenizer).__name__} renders earlier messages "
                             f"differently when later ones follow, so observation tokens cannot be appended to "
                             f"the sampled ones; use a template that renders each message independently")
        return full[len(self.base):]
