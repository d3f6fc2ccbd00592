"""Training on multi-turn episodes: the loss mask keeps template and environment tokens out of the
gradient, the loss is normalised by the policy's tokens, and failed episodes never reach training."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coordination.layout import RunLayout
from rollout import store
from train.batches import collate, read_shard
from train.config import TrainConfig
from train.data import prepare_training_data, read_plan
from train.loss import micro_batch_loss
from train.model import Policy, load_causal_lm
from train.tiny import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Two episodes: prompt, a policy turn, an observation (mask 0), a second policy turn.
EPISODES = [
    {"prompt_ids": [1, 40, 41, 42], "completion_ids": [50, 51, 2, 60, 61, 62, 63, 52, 2],
     "loss_mask": [1, 1, 1, 0, 0, 0, 0, 1, 1], "logprobs": [-4.5, -4.6, -4.4, 0, 0, 0, 0, -4.7, -4.5],
     "advantage": 0.8},
    {"prompt_ids": [1, 43, 44], "completion_ids": [53, 2, 64, 65, 54, 55, 2],
     "loss_mask": [1, 1, 0, 0, 1, 1, 1], "logprobs": [-4.6, -4.5, 0, 0, -4.4, -4.6, -4.5], "advantage": -0.8},
]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return Policy(load_causal_lm(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")))


def gradient(policy, batch):
    policy.zero_grad(set_to_none=True)
    logp, entropy = policy(batch.input_ids, batch.attention_mask, batch.targets)
    parts = micro_batch_loss(logp, entropy, batch.loss_mask, algorithm="grpo", old_logp=batch.old_logprobs,
                             advantages=batch.advantages)
    (parts.loss / batch.loss_mask.sum()).backward()
    return torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None])


def test_environment_tokens_get_no_gradient_and_policy_tokens_do(policy):
    batch = collate(EPISODES, pad_id=0)
    assert int(batch.loss_mask.sum()) == 5 + 5  # the policy's tokens only
    base = gradient(policy, batch)
    context = batch.loss_mask == 0
    changed = collate(EPISODES, pad_id=0)
    changed.targets[context] = (changed.targets[context] + 7) % 100
    # A masked position's loss term is multiplied by exactly 0, so its target cannot reach any gradient.
    assert torch.equal(gradient(policy, changed), base)
    # The same change on one policy token does move the gradient: the comparison can fail.
    policy_change = collate(EPISODES, pad_id=0)
    first = int(batch.loss_mask[0].nonzero()[0])
    policy_change.targets[0, first] = (policy_change.targets[0, first] + 7) % 100
    assert not torch.equal(gradient(policy, policy_change), base)


def row(task, s, reward, termination="done"):
    ep = EPISODES[s % 2]
    return {"task_id": task, "sample_index": s, "prompt": "p", "prompt_ids": ep["prompt_ids"],
            "completion_ids": ep["completion_ids"], "logprobs": ep["logprobs"], "loss_mask": ep["loss_mask"],
            "turn_starts": [0, 7 if s % 2 == 0 else 4], "turns": 2, "termination": termination,
            "error": "boom" if termination == "env_error" else None, "step_rewards": [reward],
            "reward_parts": [{"name": "env", "value": reward}], "text": "x",
            "reward": reward, "finish_reason": "stop", "policy_iteration": 0, "iteration": 1, "split": "train",
            "rank": 0, "generation": 1}


def test_plan_counts_policy_tokens_and_leaves_out_groups_with_a_failed_episode(tmp_path):
    layout = RunLayout(tmp_path)
    rows = [row("ok", 0, 1.0), row("ok", 1, 0.0), row("bad", 0, 1.0), row("bad", 1, 0.0, "env_error")]
    store.write_rows(layout.rollout_all("train", 1), rows, run_id="run-a")
    plan = read_plan(prepare_training_data(layout, 1, TrainConfig(steps_per_iteration=1), run_id="run-a",
                                           world_size=1, temperature=1.0, input_checkpoint=Path("/m"),
                                           input_iteration=0))
    assert plan["stats"]["env_failed_groups"] == 1 and plan["stats"]["samples_kept"] == 2
    assert [s["completion_tokens"] for s in plan["steps"]] == [10]  # 5 + 5 policy tokens, not 16 tokens
    shard = read_shard(layout.training_dir(1) / plan["shards"][0]["file"], plan["shards"][0]["sha256"])
    shard_rows = [r for rs in shard.values() for r in rs]
    assert {r["task_id"] for r in shard_rows} == {"ok"}
    assert sorted(tuple(r["loss_mask"]) for r in shard_rows) == sorted(tuple(e["loss_mask"]) for e in EPISODES)
