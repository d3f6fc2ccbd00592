"""Building the policy module the trainer differentiates.

`Policy` wraps a Hugging Face causal LM so that one forward returns per-token logprobs and
entropy of given targets. Parallelism (train/parallel.py) wraps `Policy` itself, which makes it
the FSDP2 root: the embedding, final norm and LM head it owns are gathered for its forward, while
each decoder block is its own FSDP2 unit. The memory and speed levers (assembled in
train/build.py) hook in here: the attention implementation (`load_causal_lm`), LoRA layers that
peft injects into `lm`, the chunked LM head and activation offloading (`Policy`), activation
checkpointing and torch.compile per block (`decoder_blocks`).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from train.chunked_head import chunked_logprobs_and_entropy
from train.context import ContextParallel, check_right_padded
from train.loss import token_logprobs_and_entropy


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype forward/backward run in: auto = bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def quiet_transformers() -> None:
    """No per-file progress bars in trainer logs (one line per step is what people read)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_causal_lm(path: Path, attn: str = "sdpa") -> nn.Module:
    """The model of a Hugging Face folder, in float32: the master weights the optimizer updates.
    Mixed precision casts copies for compute (parallel.py), never these. `attn` is the transformers
    attention implementation (sdpa, flash_attention_2 or eager; see train/build.py for the checks)."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn)
    except OSError as exc:
        raise FileNotFoundError(f"cannot load a model from {path}: {exc}") from None
    return model


def decoder_blocks(lm: nn.Module) -> list[nn.Module]:
    """The transformer blocks of `lm`: modules whose class the model declares unsplittable."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    blocks = [m for m in lm.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"cannot find the decoder blocks of {type(lm).__name__} (no module of the classes "
                         f"{sorted(names)}); FSDP2 needs them to shard block by block")
    return blocks


class Policy(nn.Module):
    """forward(input_ids, attention_mask, targets, temperature) -> (logp, entropy), both [B, T-1].

    `head_chunk`: tokens per chunk of the chunked LM head (None = all logits at once);
    `activation_offload`: a context (train/offload.py) the forward runs in, or None;
    `context`: this rank's place in a context-parallel group (train/context.py), or None. With it,
    logp and entropy cover only this rank's slice of the positions ([B, S], `context.local`)."""

    def __init__(self, lm: nn.Module, *, head_chunk: int | None = None,
                 activation_offload: contextlib.AbstractContextManager | None = None,
                 context: ContextParallel | None = None):
        super().__init__()
        self.lm = lm
        self.head_chunk = head_chunk
        self.activation_offload = activation_offload
        self.context = context

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        body = getattr(self.lm, self.lm.base_model_prefix)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        cp = self.context
        if cp is not None:
            check_right_padded(attention_mask)
            # Causality hides the padding (train/context.py), so no mask; the slice's rotary
            # positions are its global ones.
            inputs = {"input_ids": cp.local(input_ids), "position_ids": cp.positions(input_ids),
                      "context_parallel": cp}
            targets = cp.predictions(targets)
        with self.activation_offload if self.activation_offload is not None else contextlib.nullcontext():
            hidden = body(**inputs, use_cache=False).last_hidden_state
            if cp is None:
                hidden = hidden[:, :-1]
            head = self.lm.get_output_embeddings()
            if self.head_chunk is not None:
                return chunked_logprobs_and_entropy(hidden, head, targets, temperature, self.head_chunk)
            return token_logprobs_and_entropy(hidden, head, targets, temperature)


    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 pad_token_id: int, eos_token_id: int, synced: bool) -> torch.Tensor:
        """Greedy continuation of left-padded prompts. Under FSDP2 this is registered as a forward
        method, so the root's parameters are gathered for it; `synced` keeps every rank stepping
        until all ranks are done, since each step's forward is a collective."""
        whole = self.context.whole_sequences(self.lm) if self.context is not None else contextlib.nullcontext()
        with whole:
            return self.lm.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                    max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                                    eos_token_id=eos_token_id, synced_gpus=synced, use_cache=True)


def named_master_params(policy: Policy) -> list[tuple[str, nn.Parameter]]:
    """Trained parameters under their Hugging Face names (tied weights once), the keys of optimizer
    state. With LoRA these are the adapters only: the frozen base weights have no optimizer state."""
    return [(n, p) for n, p in policy.lm.named_parameters() if p.requires_grad]


def trainable_parameters(policy: Policy) -> list[nn.Parameter]:
    return [p for p in policy.parameters() if p.requires_grad]
