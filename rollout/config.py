"""Config sections of the rollout side: `tasks` (what to roll out and how to score it) and
`rollout` (how to sample and how the worker writes its chunks)."""
from __future__ import annotations

from dataclasses import dataclass

from coordination.config import ConfigError, non_negative, option, positive, section
from rollout.judge.config import JudgeConfig

ENV_REWARDS = ("sum", "last", "none")  # tasks.env_reward


@dataclass
class TasksConfig:
    """Task files and the reward that scores them (docs/design.md §7)."""

    train_file: str = option("train.jsonl", "JSONL file of training tasks, relative to --data-path")
    eval_file: str = option("eval.jsonl", "JSONL file of eval tasks, relative to --data-path")
    tasks_per_iteration: int = option(
        64, "tasks sampled (seeded by rollout.seed and the iteration) from the train file each iteration")
    eval_tasks: int = option(
        0, "eval tasks per evaluation; 0 = the whole eval file. The same tasks every evaluation, so accuracy "
           "is comparable across iterations")
    reward: str = option(
        "arithmetic", "reward function: 'arithmetic', 'math', or 'package.module:function' with the signature "
                      "fn(task, completion_text, finish_reason) -> float (see rollout/rewards.py)")
    env: str = option(
        "", "environment of multi-turn episodes (docs/design.md §7): '' = single-turn (the task's prompt, one "
            "completion, scored by `reward`); 'calculator', 'guess', 'web', or 'package.module:factory', a callable "
            "that takes the task and returns an object with reset() -> messages and step(assistant_text) -> (messages, "
            "reward, done). With an environment the episode's reward is made of the parts env_reward, "
            "reward_with_env and judge choose (rollout/scoring.py)")
    env_reward: str = option(
        "sum", "with tasks.env: how the environment's step rewards become the episode's 'env' reward part: 'sum' "
               "(of every reward a step gave), 'last' (the last reward a step gave; 0 if none did) or 'none' (the "
               "environment's rewards are ignored, e.g. when a judge scores the episode)")
    reward_with_env: bool = option(
        False, "with tasks.env: also score each whole episode with `reward` (its 'reward' part): the function gets "
               "the task, the text of the last policy turn, its finish_reason and, when it has a parameter named "
               "'messages', the episode's messages (reset's, then each turn and observation)")
    reward_timeout: float = option(
        30.0, "seconds one reward call may take: a longer one at the start check refuses the run (exit 2); during a "
              "rollout it ends that sample (finish_reason reward_timeout, reward 0, counted in the rollout stats, "
              "its group not trained on). The call's thread cannot be stopped and runs on in the background")

    judge: JudgeConfig = section(JudgeConfig, "an LLM judge scoring each episode (its 'judge' reward part)")

    def __post_init__(self) -> None:
        for key in ("train_file", "eval_file"):
            if not getattr(self, key).strip():
                raise ConfigError(f"{key} must name a JSONL file relative to --data-path (got an empty string)")
        positive(self.tasks_per_iteration, "tasks_per_iteration")
        positive(self.reward_timeout, "reward_timeout")
        non_negative(self.eval_tasks, "eval_tasks")
        if not self.reward.strip():
            raise ConfigError("reward must be 'arithmetic', 'math' or 'package.module:function' (got an empty string)")
        if self.reward not in ("arithmetic", "math") and ":" not in self.reward:
            raise ConfigError(f"reward={self.reward!r} is neither 'arithmetic', 'math' nor 'package.module:function'")
        if self.env_reward not in ENV_REWARDS:
            raise ConfigError(f"env_reward={self.env_reward!r} is not one of {', '.join(ENV_REWARDS)}: 'sum' adds the "
                              f"environment's step rewards, 'last' keeps the last one, 'none' ignores them")


@dataclass
class RolloutConfig:
    """Sampling and the rollout worker (docs/design.md §6 phases 1 and 5)."""

    group_size: int = option(8, "samples per task for training rollouts (the GRPO group)")
    max_new_tokens: int = option(8, "most tokens sampled per completion; a completion cut here has finish_reason 'length'")
    temperature: float = option(1.0, "sampling temperature of training rollouts (0 = greedy)")
    top_p: float = option(1.0, "nucleus sampling threshold of training rollouts, in (0, 1]")
    seed: int = option(0, "seed of the per-iteration task sample and of the sampler")
    eval_group_size: int = option(1, "samples per eval task; with 1, accuracy is that of one sample per task")
    eval_temperature: float = option(0.0, "sampling temperature of eval rollouts (0 = greedy)")
    chunk_groups: int = option(8, "the worker publishes a chunk file once this many task groups are finished")
    chunk_seconds: float = option(
        30.0, "... or once this many seconds have passed since its last chunk, whichever comes first")
    prompts_per_call: int = option(
        32, "task prompts per engine call (each with its group of samples) for engines that batch in their "
            "own process (transformers); larger batches are faster but lose more work when a node dies mid-call. "
            "vLLM takes all of a rank's tasks in one rolling window instead (inference.vllm.max_concurrency)")
    max_turns: int = option(8, "most policy turns of an environment episode; one still going after them ends (termination max_turns)")
    max_episode_tokens: int = option(
        4096, "most tokens of an environment episode (prompt + every turn + every observation), checked before each "
              "generation: an episode that could pass it in its next turn ends (termination max_tokens). With "
              "tasks.env it must fit the model's positions (checked at the start). A single-turn task is one turn of "
              "max_new_tokens, its prompt checked against the model's positions")
    env_step_timeout: float = option(
        60.0, "seconds one environment call (factory + reset, step, close) may take; past it the episode ends "
              "(termination timeout) and the call is abandoned on its thread")
    max_env_error_rate: float = option(
        0.1, "a rank's rollout fails, quoting the first errors, when more than this fraction of its episodes of "
             "an iteration ended with env_error, timeout or judge_error; those episodes' groups are never trained on")
    success_reward: float = option(
        1.0, "a sample counts as solved (pass@k, all-solved/none-solved groups) when its reward is at least this")

    def __post_init__(self) -> None:
        for key in ("group_size", "max_new_tokens", "eval_group_size", "chunk_groups", "prompts_per_call", "max_turns",
                    "max_episode_tokens", "env_step_timeout"):
            positive(getattr(self, key), key)
        non_negative(self.temperature, "temperature")
        non_negative(self.eval_temperature, "eval_temperature")
        positive(self.chunk_seconds, "chunk_seconds")
        if not 0 <= self.max_env_error_rate <= 1:
            raise ConfigError(f"max_env_error_rate must be in [0, 1] (got {self.max_env_error_rate}); 0 fails on the "
                              f"first environment error, 1 never fails")
        if self.max_episode_tokens <= self.max_new_tokens:
            raise ConfigError(f"max_episode_tokens={self.max_episode_tokens} leaves no room for a prompt beside "
                              f"max_new_tokens={self.max_new_tokens}; raise max_episode_tokens")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (got {self.top_p}); 1 disables nucleus sampling")
        if self.eval_temperature == 0 and self.eval_group_size > 1:
            raise ConfigError(
                f"eval_group_size={self.eval_group_size} with eval_temperature=0 samples the same greedy completion "
                f"{self.eval_group_size} times; set eval_group_size=1 or a positive eval_temperature")
