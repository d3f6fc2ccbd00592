"""The Hugging Face checkpoint layout of stacked expert tensors.

transformers 5 holds a layer's experts as two stacked tensors, `<layer>.experts.gate_up_proj`
[E, 2I, H] (each expert's gate rows, then its up rows) and `<layer>.experts.down_proj` [E, H, I],
and converts them from and to one tensor per expert when it loads and saves. vLLM reads the
per-expert names only, so a published checkpoint must carry those. Per family:
- Qwen2/3-MoE, OLMoE: `<layer>.experts.<e>.gate_proj.weight`, `.up_proj.weight`, `.down_proj.weight`;
- Mixtral: `<layer with .mlp. as .block_sparse_moe.>.experts.<e>.w1.weight` (gate), `.w3.weight`
  (up), `.w2.weight` (down).
Other families keep the stacked names (transformers loads them as they are).
"""
from __future__ import annotations

import torch

GATE_UP, DOWN = ".experts.gate_up_proj", ".experts.down_proj"
# model_type -> (rename of the layer path, gate name, up name, down name)
LAYOUTS = {
    "qwen3_moe": (None, "gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": (None, "gate_proj", "up_proj", "down_proj"),
    "olmoe": (None, "gate_proj", "up_proj", "down_proj"),
    "mixtral": ((".mlp.", ".block_sparse_moe."), "w1", "w3", "w2"),
}


def is_stacked_expert(name: str) -> bool:
    return name.endswith(GATE_UP) or name.endswith(DOWN)


def stored_name(model_type: str, name: str) -> str:
    """The checkpoint name of a model tensor other than stacked experts (Mixtral's router and
    norms live under `.block_sparse_moe.` in its files, `.mlp.` in the model)."""
    layout = LAYOUTS.get(model_type)
    return name.replace(*layout[0]) if layout is not None and layout[0] is not None else name


def checkpoint_tensors(model_type: str, name: str, tensor: torch.Tensor,
                       first_expert: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs a model tensor is published as: one per expert for stacked
    experts (`tensor` holding experts first_expert, first_expert+1, ... of the layer), the family's
    renamed layer path for the rest (Mixtral's router too); [(name, tensor)] for other families."""
    layout = LAYOUTS.get(model_type)
    if layout is None:
        return [(name, tensor)]
    _, gate, up, down = layout
    renamed = stored_name(model_type, name)
    if not is_stacked_expert(name):
        return [(renamed, tensor)]
    experts = renamed[:-len(GATE_UP)] if name.endswith(GATE_UP) else renamed[:-len(DOWN)]
    out = []
    for i, expert in enumerate(tensor):
        prefix = f"{experts}.experts.{first_expert + i}"
        if name.endswith(GATE_UP):
            g, u = expert.chunk(2, dim=0)
            out += [(f"{prefix}.{gate}.weight", g), (f"{prefix}.{up}.weight", u)]
        else:
            out.append((f"{prefix}.{down}.weight", expert))
    return out
