"""Accuracy metrics of rollouts (docs/design.md §6 phases 5-6) and a quick in-memory evaluation.

pass@k uses the unbiased estimator of Chen et al. (2021): for a task with n samples of which c
are solved, pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks. With one greedy sample per
task (the default eval), accuracy is simply the mean reward.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout.engine import Engine, Sampling
from rollout.rewards import RewardFn
from rollout.tasks import Task
from rollout.worker import roll_groups


def pass_at_k(n: np.ndarray, c: np.ndarray, k: int) -> float:
    """Mean unbiased pass@k over tasks with n samples and c solved each (requires k <= n)."""
    n, c = np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64)
    if n.size == 0:
        return 0.0
    if k < 1 or np.any(n < k):
        raise ValueError(f"pass@{k} needs at least {k} samples per task (smallest group: {int(n.min())})")
    # C(n-c,k)/C(n,k) = prod_{i=n-c+1}^{n} (1 - k/i): a cumulative product over i = n, n-1, ...
    # gives it for every c at once (it reaches 0 once n-c < k). One table per distinct n.
    out = np.empty(n.size, dtype=np.float64)
    for size in np.unique(n):
        fail = np.concatenate([[1.0], np.cumprod(1.0 - k / np.arange(size, 0, -1, dtype=np.float64))])
        sel = n == size
        out[sel] = 1.0 - fail[c[sel]]
    return float(out.mean())


def ks_for(group_size: int) -> list[int]:
    """1, 2, 4, ... up to the group size, and the group size itself."""
    ks, k = [], 1
    while k < group_size:
        ks.append(k)
        k *= 2
    ks.append(group_size)
    return ks


def group_counts(table: pa.Table, success_reward: float) -> tuple[np.ndarray, np.ndarray]:
    """(samples per task, solved samples per task) from a trajectory table."""
    solved = pc.cast(pc.greater_equal(table["reward"], pa.scalar(success_reward, pa.float32())), pa.int64())
    g = pa.table({"task_id": table["task_id"], "solved": solved}).group_by("task_id").aggregate(
        [("solved", "count"), ("solved", "sum")])
    return g["solved_count"].to_numpy(), g["solved_sum"].to_numpy()


def eval_metrics(table: pa.Table, *, group_size: int, success_reward: float = 1.0) -> dict[str, Any]:
    """accuracy (mean reward with one sample per task, else pass@1), pass@k, mean completion length, count."""
    if table.num_rows == 0:
        return {"count": 0, "samples": 0, "accuracy": 0.0, "mean_completion_tokens": 0.0, "pass_at_k": {}}
    n, c = group_counts(table, success_reward)
    lengths = pc.list_value_length(table["completion_ids"])
    accuracy = float(pc.mean(table["reward"]).as_py()) if group_size == 1 else pass_at_k(n, c, 1)
    return {
        "count": int(n.size),
        "samples": table.num_rows,
        "accuracy": accuracy,
        "pass_at_k": {str(k): pass_at_k(n, c, k) for k in ks_for(int(n.min()))},
        "mean_completion_tokens": float(pc.mean(lengths).as_py()),
        "truncated": float(pc.mean(pc.cast(pc.equal(table["finish_reason"], "length"), pa.float64())).as_py()),
    }


def evaluate(engine: Engine, tokenizer: Any, tasks: Sequence[Task], reward_fn: RewardFn, *, sampling: Sampling,
             group_size: int = 1, prompts_per_call: int = 64, success_reward: float = 1.0) -> dict[str, Any]:
    """Roll out `tasks` in memory (no files) and return `eval_metrics`; for quick checks such as
    SFT's stop-on-accuracy. Uses the same prompt encoding, engine call and rewards as rollouts."""
    rows: dict[str, list] = {"task_id": [], "reward": [], "completion_ids": [], "finish_reason": []}
    for start in range(0, len(tasks), prompts_per_call):
        for g in roll_groups(engine, tokenizer, tasks[start:start + prompts_per_call], group_size, sampling, reward_fn):
            for e in g.episodes:
                rows["task_id"].append(g.task.id)
                rows["reward"].append(e.reward)
                rows["completion_ids"].append(e.ids)
                rows["finish_reason"].append(e.finish_reason)
    table = pa.table({"task_id": pa.array(rows["task_id"], pa.string()),
                      "reward": pa.array(rows["reward"], pa.float32()),
                      "completion_ids": pa.array(rows["completion_ids"], pa.list_(pa.int32())),
                      "finish_reason": pa.array(rows["finish_reason"], pa.string())})
    return eval_metrics(table, group_size=group_size, success_reward=success_reward)
