"""The bytes one checkpoint folder takes on disk (docs/design.md §11.4), from the model's shape and
the `train` config: the published weights in the serving dtype, the float32 value of every trained
parameter (`<param>::master` in the optimizer shards) and AdamW's two moments. The dry run and the
memory plan print it, with the least that retention keeps (train.keep_last folders)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from train.model_shape import DTYPE_BYTES, ModelShape, table_row


@dataclass(frozen=True)
class CheckpointSize:
    weights: float     # the served weights (none with lora.publish=adapters)
    adapters: float    # LoRA's adapter/ folder, float32 as trained
    master: float      # <param>::master: 4 B per trained parameter
    moments: float     # exp_avg and exp_avg_sq: 8 B per trained parameter
    dtype: str         # what the weights are written in
    keep_last: int

    @property
    def total(self) -> float:
        return self.weights + self.adapters + self.master + self.moments


def checkpoint_size(shape: ModelShape, train: Any, *, on_gpu: bool) -> CheckpointSize:
    """Bytes of one checkpoint of a trainer on GPUs (`on_gpu`: train.dtype=auto publishes bf16) or
    on CPU (float32); the small files (config, tokenizer, index, records) are left out."""
    dtype = train.dtype if train.dtype != "auto" else "bfloat16" if on_gpu else "float32"
    lora = shape.lora_params(train.lora.rank, train.lora.target_modules) if train.lora.rank else 0
    trained = lora or shape.params
    weights = 0.0 if lora and train.lora.publish == "adapters" else shape.params * DTYPE_BYTES[dtype]
    return CheckpointSize(weights, 4.0 * lora, 4.0 * trained, 8.0 * trained, dtype, train.keep_last)


def format_checkpoint_size(size: CheckpointSize) -> list[str]:
    """Rows for the dry run and the memory plan."""
    rows = [table_row("one checkpoint on disk", size.total, 2)]
    if size.weights:
        rows.append(table_row(f"weights ({size.dtype})", size.weights))
    if size.adapters:
        rows.append(table_row("adapter/ (float32)", size.adapters))
    rows += [table_row("fp32 state: <param>::master in optimizer/", size.master),
             table_row("AdamW moments in optimizer/", size.moments),
             table_row(f"train.keep_last={size.keep_last} checkpoints, the least retention keeps",
                       size.keep_last * size.total)]
    return rows
