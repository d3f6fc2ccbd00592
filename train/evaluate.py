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

from rollout.engine import Sampling
from rollout.engines.transformers_engine import TransformersEngine
from rollout.episodes import Bounds, run_episodes
from rollout.prompts import encode_prompt
from train.distributed import DistInfo, all_reduce_sum
from train.model import load_causal_lm
from train.parallel import full_state_dict


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


# An environment call of the eval runs on this process's threads; a built-in answers in
# microseconds, and a step past this bound ends its episode (counted as not solved).
EVAL_STEP_TIMEOUT = 30.0


class EpisodeEval:
    """Greedy success rate of environment episodes, for SFT on worked episodes (collective).

    The episodes run as rollouts run them (rollout/episodes.py, the transformers engine), on a
    plain copy of the model on rank 0 that takes the trained weights before every eval: a
    sharded model's forward is a collective, and episodes take a different number of rounds on
    each rank. The other ranks wait in the sum of the counts."""

    def __init__(self, model_path: Any, tokenizer: Any, tasks: Sequence[Any], env_factory: Callable[[Any], Any], *,
                 max_turns: int, max_new_tokens: int, success: float = 1.0):
        self.model_path, self.tokenizer, self.tasks, self.factory = model_path, tokenizer, list(tasks), env_factory
        self.max_turns, self.max_new_tokens, self.success = max_turns, max_new_tokens, success
        self.engine = None

    def __call__(self, policy: Any, info: DistInfo) -> float:
        state = full_state_dict(policy)
        solved = self._solved(state) if info.is_main else 0
        (total,) = all_reduce_sum([float(solved)], info.device)
        return total / len(self.tasks)

    def _solved(self, state: dict[str, torch.Tensor]) -> int:
        if self.engine is None:
            self.engine = TransformersEngine()
            self.engine.serve(load_causal_lm(self.model_path), self.tokenizer, self.model_path)
        missing, unexpected = self.engine.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self.engine.model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"the trained weights do not fit the eval copy of {self.model_path} (missing "
                               f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
        rewards: list[float] = []

        def unused(*_: Any) -> float:
            raise RuntimeError("environment episodes are scored by their environment, not a reward function")

        run_episodes(self.engine, self.tokenizer, self.tasks, 1, Sampling(self.max_new_tokens, temperature=0.0),
                     reward_fn=unused, env_factory=self.factory,
                     bounds=Bounds(self.max_turns, self._positions(), EVAL_STEP_TIMEOUT),
                     on_group=lambda g: rewards.extend(e.reward for e in g.episodes))
        return sum(r >= self.success for r in rewards)

    def _positions(self) -> int:
        """An episode's token bound: the model's positions, as rollouts check them."""
        if not self.engine.max_positions:
            raise ValueError(f"{self.model_path}'s config has no max_position_embeddings; the episode eval bounds "
                             f"each episode by it")
        return int(self.engine.max_positions)
