"""The sizes of a Llama-style decoder that memory and disk use depend on, read from the model's
`config.json` alone (no weights): the memory plan (train/memory_plan.py) and the checkpoint bytes
of the dry run build on them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordination.config import ConfigError
from train.config import model_experts

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def table_row(name: str, nbytes: float, indent: int = 4) -> str:
    """One row of the plan's tables: the name, then GiB right-aligned at column 88."""
    return f"{' ' * indent}{name:<{82 - indent}} {nbytes / GIB:7.2f}"


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that memory depends on (read from config.json)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False
    attention_bias: bool = False
    # Mixture of experts (0 experts: dense): each sparse layer's MLP is `experts` MLPs of width
    # expert_intermediate plus a router, and a shared expert where the family has one (Qwen2-MoE).
    experts: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_layers: int = 0          # layers of an MoE model whose MLP stays dense (mlp_only_layers)
    top_k: int = 0                 # experts each token is routed to

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "ModelShape":
        c = c.get("text_config") or c  # multimodal configs nest the language model's
        try:
            h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
            return cls(hidden=h, layers=int(c["num_hidden_layers"]), heads=heads,
                       kv_heads=int(c.get("num_key_value_heads") or heads),
                       head_dim=int(c.get("head_dim") or h // heads), intermediate=int(c["intermediate_size"]),
                       vocab=int(c["vocab_size"]), tied=bool(c.get("tie_word_embeddings", False)),
                       attention_bias=bool(c.get("attention_bias", False)), **_moe_sizes(c))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the model's config.json lacks a decoder size the memory plan needs ({exc}); it reads "
                              f"hidden_size, num_hidden_layers, num_attention_heads, intermediate_size and "
                              f"vocab_size") from None

    @classmethod
    def from_model_dir(cls, path: Path) -> "ModelShape":
        file = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {file} for the memory plan: {exc}") from None

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one block, by its Hugging Face name."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def expert_params(self) -> int:
        """One sparse layer's experts (the tensors train.ep shards); 0 for a dense model."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def all_expert_params(self) -> int:
        """Every sparse layer's experts: what train.ep divides by ep instead of FSDP2's dp_shard."""
        return (self.layers - self.dense_layers) * self.expert_params if self.experts else 0

    def _block(self, sparse: bool) -> int:
        bias = self.q_width + 2 * self.kv_width if self.attention_bias else 0
        shapes = self.linear_shapes()
        attention = sum(a * b for name, (a, b) in shapes.items() if name.endswith(("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj")))
        if sparse:
            shared = 3 * self.hidden * self.shared_intermediate + (self.hidden if self.shared_intermediate else 0)
            mlp = self.expert_params + self.experts * self.hidden + shared
        else:
            mlp = 3 * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden + bias

    @property
    def block_params(self) -> int:
        """The largest block (a sparse one in an MoE model: FSDP2 gathers all its experts at ep=1)."""
        return self._block(sparse=self.experts > 0)

    @property
    def root_params(self) -> int:
        """Embedding, LM head (unless tied to the embedding) and final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        if not self.experts:
            return self.layers * self.block_params + self.root_params
        sparse = self.layers - self.dense_layers
        return sparse * self._block(True) + self.dense_layers * self._block(False) + self.root_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        per_block = sum(rank * (a + b) for name, (a, b) in shapes.items() if name in targets)
        head = rank * (self.hidden + self.vocab) if "lm_head" in targets else 0
        return self.layers * per_block + head

    def block_activation_bytes(self, d: int) -> int:
        """A: bytes one block keeps for backward per token without checkpointing (module docstring).
        A sparse block's MLP keeps, for each of the token's top_k experts, its row as the expert
        received it and the expert's output before the router weights it (2 h), and gate,
        silu(gate), up and their product at the expert's width (4 I_e), instead of a dense 4 i."""
        h = self.hidden
        mlp = 2 * self.top_k * h + 4 * self.top_k * self.expert_intermediate if self.experts else 4 * self.intermediate
        return 2 * (4 + d) * h + d * (2 * h + 2 * self.q_width + 2 * self.kv_width + mlp) + 4 * self.heads

    def kv_cache_bytes_per_token(self, d: int) -> int:
        return 2 * self.layers * self.kv_width * d


def _moe_sizes(c: dict[str, Any]) -> dict[str, int]:
    """ModelShape's expert fields from a config: Qwen2/3-MoE and OLMoE (num_experts,
    moe_intermediate_size, mlp_only_layers, decoder_sparse_step, Qwen2-MoE's shared expert) and
    Mixtral (num_local_experts, each intermediate_size wide)."""
    experts = model_experts(c)
    if not experts:
        return {}
    layers, step = int(c["num_hidden_layers"]), int(c.get("decoder_sparse_step") or 1)
    dense_only = set(c.get("mlp_only_layers") or [])
    dense = sum(1 for i in range(layers) if i in dense_only or (i + 1) % step)
    return {"experts": experts, "expert_intermediate": int(c.get("moe_intermediate_size") or c["intermediate_size"]),
            "shared_intermediate": int(c.get("shared_expert_intermediate_size") or 0), "dense_layers": dense,
            "top_k": int(c.get("num_experts_per_tok") or 1)}
