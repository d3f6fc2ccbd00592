"""The rules of the composed config against this node: model, trainer launch, task files, reward,
secrets, GPU memory."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from coordination.config import ConfigError, resolve_secret
from rl.model_inputs import check_model_inputs
from rl.plan import job_plan
from rl.validate import Failure, Rule, by_message, failures
from rollout.inference import VLLM_LORA_RANKS
from rollout.envs import EnvError, check_env
from rollout.judge.score import JudgeError, load_parser
from rollout.rewards import RewardError, check_reward
from rollout.tasks import TaskFileError
from train.config import check_ep_launch, check_world_size
from train.lora_targets import check_moe_lora_targets
from train.context_rules import check_cp_launch
from train.memory_check import check_memory


class RunInputs:
    """What RUN_RULES judge: the parsed flags, the composed config and the plan made of them; the
    task files are read once and shared by the rules that need them."""

    def __init__(self, args: Any, cfg: Any):
        self.args, self.cfg = args, cfg
        self.plan = job_plan(args, cfg)
        kind = args.kind
        self.splits = (["train"] if kind.rolls_out else []) + \
            (["eval"] if kind.only_evaluates or (kind.evaluates and cfg.run.eval_interval > 0) else [])

    @property
    def serves_from_model(self) -> bool:
        """Jobs that serve start their engine on model.path (an update job only names it)."""
        return self.args.kind.serves

    def pools(self) -> dict[str, tuple[list, Path]]:
        """split -> (its tasks, its file), once the task-files rule passed."""
        return {split: (self.plan.pool(split), self.plan.task_file(split)) for split in self.splits}


def bench_model_is_folder(r: RunInputs) -> str | None:
    path = r.cfg.model.path
    if r.args.kind.benchmarks and path and not Path(path).is_dir():
        return (f"model.path={path} is not a folder on this node; give the Hugging Face model to benchmark, or "
                f"leave model.path empty to benchmark the tiny model")
    return None


def model_path_given(r: RunInputs) -> str | None:
    if not r.args.kind.benchmarks and not r.cfg.model.path:
        return ("model.path is empty: give the starting checkpoint, e.g. model.path=/models/qwen or in a --config "
                "YAML file")
    return None


def model_path_exists(r: RunInputs) -> str | None:
    if r.serves_from_model and not Path(r.cfg.model.path).exists():
        return (f"model.path={r.cfg.model.path} does not exist on this node; every node must see the starting "
                f"checkpoint at the same path")
    return None


def lora_rank_served(r: RunInputs) -> str | None:
    """Checked now, not when the first adapters-only checkpoint is served after a whole iteration.
    A user's own server (debug_url) has its own LoRA settings."""
    lora, inf = r.cfg.train.lora, r.cfg.inference
    if not (r.serves_from_model and lora.rank and lora.publish == "adapters" and inf.engine == "vllm"
            and not inf.vllm.debug_url and inf.vllm.max_lora_rank < lora.rank):
        return None
    fit = next((x for x in VLLM_LORA_RANKS if x >= lora.rank), VLLM_LORA_RANKS[-1])
    return (f"train.lora.publish=adapters makes vLLM serve LoRA adapters of rank {lora.rank}, but "
            f"inference.vllm.max_lora_rank={inf.vllm.max_lora_rank}; set it to a rank vLLM accepts that is at least "
            f"{lora.rank} (e.g. inference.vllm.max_lora_rank={fit}), or use train.lora.publish=merged")


def trainer_world_size(r: RunInputs) -> str | None:
    """HSDP's dp_replicate must divide the trainer processes: found at start, not at phase 10."""
    train = r.cfg.train
    if not (r.args.kind.trains and train.backend == "fsdp"):
        return None
    return by_message(lambda: check_world_size(train.dp_replicate, r.args.num_nodes * train.nproc_per_node))


def expert_parallel_degree(r: RunInputs) -> str | None:
    """train.ep divides the trainer processes and the model's experts (a dense model has none)."""
    train = r.cfg.train
    if not r.args.kind.trains:
        return None
    return by_message(lambda: check_ep_launch(train, r.args.num_nodes, r.cfg.model.path))


def lora_targets_moe(r: RunInputs) -> str | None:
    """LoRA's target_modules reach linear layers this model has (an MoE model's experts are none)."""
    train, config = r.cfg.train, Path(str(r.cfg.model.path)) / "config.json"
    if not (r.args.kind.trains and train.lora.rank and str(r.cfg.model.path) and config.is_file()):
        return None
    return by_message(lambda: check_moe_lora_targets(train.lora, json.loads(config.read_text())))
def context_parallel_degree(r: RunInputs) -> str | None:
    """train.cp stays within a node, divides the trainer processes and the model's heads and kv
    heads, on a model whose attention is plain causal attention."""
    if not r.args.kind.trains:
        return None
    return by_message(lambda: check_cp_launch(r.cfg.train, r.args.num_nodes, r.cfg.model.path))


def flash_attn_installed(r: RunInputs) -> str | None:
    train = r.cfg.train
    if r.args.kind.trains and train.attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return ("train.attn=flash_attention_2 needs the flash-attn package, which this node's Python does not have: "
                "pip install flash-attn --no-build-isolation on every GPU node, or set train.attn=sdpa")
    return None


def task_files(r: RunInputs) -> str | None:
    """Every task file this job reads parses: all lines, UTF-8."""
    for split in r.splits:
        try:
            r.plan.pool(split)
        except (ConfigError, TaskFileError) as exc:
            return str(exc)
    return None


def reward_scores(r: RunInputs) -> str | None:
    """The reward loads and returns a finite number on a sample task within tasks.reward_timeout."""
    if not r.splits:
        return None
    try:
        check_reward(r.cfg.tasks.reward, r.plan.pool(r.splits[0])[0], r.cfg.tasks.reward_timeout)
    except RewardError as exc:
        return str(exc)
    return None


def env_starts(r: RunInputs) -> str | None:
    """The environment (tasks.env) loads and gives its first messages on a sample task within
    rollout.env_step_timeout."""
    if not (r.splits and r.cfg.tasks.env):
        return None
    try:
        check_env(r.cfg.tasks.env, r.plan.pool(r.splits[0])[0], r.cfg.rollout.env_step_timeout)
    except EnvError as exc:
        return str(exc)
    return None


def judge_ready(r: RunInputs) -> str | None:
    """tasks.judge: its key resolves, its URL or model folder is there, its parser loads, and a vLLM
    judge beside a vLLM policy on the same GPUs leaves them room."""
    judge = r.cfg.tasks.judge
    if not (judge.enabled and r.splits):
        return None
    if judge.url and judge.api_key:
        problem = by_message(lambda: resolve_secret(judge.api_key, "tasks.judge.api_key"))
        if problem:
            return problem
    if not judge.url and not Path(judge.model).is_dir():
        return (f"tasks.judge.model={judge.model} is not a folder on this node; give the judge model's Hugging Face "
                f"folder (every node serves it), or set tasks.judge.url to an OpenAI-compatible server")
    try:
        load_parser(judge.parser)
    except JudgeError as exc:
        return str(exc)
    policy = r.cfg.inference
    if (not judge.url and judge.engine == "vllm" and not policy.vllm.cpu and policy.engine == "vllm"
            and policy.vllm.gpu_memory_utilization + judge.gpu_memory_utilization > 1):
        return (f"inference.vllm.gpu_memory_utilization={policy.vllm.gpu_memory_utilization} and "
                f"tasks.judge.gpu_memory_utilization={judge.gpu_memory_utilization} add up to more than the GPU; "
                f"lower one of them so that the two vLLM servers fit together")
    return None


def enough_tasks(r: RunInputs) -> str | None:
    """tasks_per_iteration / eval_tasks fit the files (the sampler's own check)."""
    for split in r.splits:
        try:
            r.plan.tasks_of(split, 1)
        except ValueError as exc:
            return f"{exc} ({r.plan.task_file(split)})"
    return None


def secrets_resolve(r: RunInputs) -> str | None:
    """An unset env: or unreadable file: reference of the engine is found now."""
    vllm = r.cfg.inference.vllm
    if r.args.kind.serves and r.cfg.inference.engine == "vllm":
        return by_message(lambda: (vllm.resolved_api_key(), vllm.resolved_env()))
    return None


def model_fits_inputs(r: RunInputs) -> str | None:
    """rl/model_inputs.py: config.json loads, max_new_tokens leaves room, every prompt fits."""
    if not r.args.kind.serves:
        return None
    return by_message(lambda: check_model_inputs(r.cfg, r.pools()))


def memory_fits(r: RunInputs) -> str | None:
    """A trainer and an engine that share the GPUs and do not fit would fail at the first step."""
    if r.args.kind.benchmarks:
        return None
    return by_message(lambda: check_memory(r.cfg, serves=r.args.kind.serves, trains=r.args.kind.trains,
                                           num_nodes=r.args.num_nodes, debug_mode=r.args.debug_mode))


RUN_RULES: tuple[Rule, ...] = (
    Rule("bench-model-is-folder", bench_model_is_folder),
    Rule("model-path-given", model_path_given),
    Rule("model-path-exists", model_path_exists, needs=("model-path-given",)),
    Rule("lora-rank-served", lora_rank_served),
    Rule("trainer-world-size", trainer_world_size),
    Rule("expert-parallel-degree", expert_parallel_degree),
    Rule("lora-targets-moe", lora_targets_moe),
    Rule("context-parallel-degree", context_parallel_degree),
    Rule("flash-attn-installed", flash_attn_installed),
    Rule("task-files", task_files),
    Rule("reward-scores", reward_scores, needs=("task-files",)),
    Rule("env-starts", env_starts, needs=("task-files",)),
    Rule("enough-tasks", enough_tasks, needs=("task-files",)),
    Rule("judge-ready", judge_ready),
    Rule("secrets-resolve", secrets_resolve),
    Rule("model-fits-inputs", model_fits_inputs, needs=("model-path-given", "model-path-exists", "task-files")),
    Rule("memory-fits", memory_fits),
)


def run_failures(args: Any, cfg: Any) -> list[Failure]:
    """Every RUN_RULES failure of this command on this node."""
    return failures(RUN_RULES, RunInputs(args, cfg))
