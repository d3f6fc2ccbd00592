"""Greedy exact-match accuracy during SFT, on every rank in lockstep.

SFT of the tiny model stays near 0 % for ~275 steps and then jumps within ~100 (measured,
docs/design.md §10.4), so the demo stops on an accuracy target instead of a step count. All
ranks evaluate together: each takes an equal-sized slice of the eval tasks (padded by repeating
its own, uncounted), generates greedily, scores with a rollout reward function, and the counts
are summed over ranks, so every rank sees the same accuracy and stops at the same step.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from rollout.prompts import encode_prompt
from train.distributed import DistInfo, all_reduce_sum


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def completion_of(tokens: Sequence[int], eos_id: int) -> tuple[list[int], str]:
    """Tokens up to (not including) the first EOS, and the finish reason."""
    tokens = [int(t) for t in tokens]
    if eos_id in tokens:
        return tokens[:tokens.index(eos_id)], "stop"
    return tokens, "length"


def greedy_accuracy(generate: Callable[..., torch.Tensor], tokenizer: Any, tasks: Sequence[Any],
                    reward: Callable[[Any, str, str], float], *, info: DistInfo, batch_size: int,
                    max_new_tokens: int, synced: bool, success: float = 1.0) -> float:
    """Fraction of `tasks` whose greedy completion earns at least `success` (collective)."""
    mine = list(tasks[info.rank::info.world_size])
    per_rank = math.ceil(len(tasks) / info.world_size)
    padded = [(t, True) for t in mine] + [(mine[0] if mine else tasks[0], False)] * (per_rank - len(mine))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    correct = 0
    for start in range(0, per_rank, batch_size):
        batch = padded[start:start + batch_size]
        prompts = [encode_prompt(tokenizer, task) for task, _ in batch]
        ids, mask = _left_pad(prompts, pad_id)
        out = generate(ids.to(info.device), mask.to(info.device), max_new_tokens=max_new_tokens,
                       pad_token_id=pad_id, eos_token_id=eos_id, synced=synced)
        for (task, counted), row in zip(batch, out[:, ids.shape[1]:].tolist()):
            if not counted:
                continue
            tokens, finish = completion_of(row, eos_id)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            correct += reward(task, text, finish) >= success
    (total_correct,) = all_reduce_sum([float(correct)], info.device)
    return total_correct / len(tasks)
