"""What the config and flags decide, the same on every node (docs/design.md §6): the job kind,
which iterations evaluate, which tasks an iteration has and how they split over the ranks, and
the phase-10 torchrun command. Needs no node, so dry runs use it too."""
from __future__ import annotations

import sys
from pathlib import Path

from coordination.config import ConfigError
from coordination.layout import RunLayout
from coordination.phases import PhaseId
from rl.jobs import JobKind
from rl.model_inputs import check_model_inputs
from rl.run_cli import RunArgs
from rl.runconfig import RunConfig
from rollout.envs import EnvError, check_env
from rollout.rewards import RewardError, check_reward
from rollout.split import sample_iteration, select_eval, split_plan
from rollout.tasks import TaskFileError, load_tasks
from train.launch import torchrun_command


class RunPlan:
    """The plan of an RL job (both, rollout, update, eval)."""

    def __init__(self, args: RunArgs, cfg: RunConfig):
        self.args, self.cfg = args, cfg
        self.kind: JobKind = args.kind
        self._pools: dict[str, list] = {}

    @property
    def final_eval_on(self) -> bool:
        return self.cfg.run.eval_interval > 0 and self.cfg.run.final_eval and self.kind.evaluates

    @property
    def last_iteration(self) -> int:
        """max_iterations, plus one evaluation-only iteration that measures the final checkpoint
        when evaluation is on."""
        return self.cfg.run.max_iterations + (1 if self.final_eval_on else 0)

    @property
    def resident_trainer(self) -> bool:
        """Whether phase 10 gives its work to a trainer that lives across iterations (train.resident,
        docs/design.md §9.6)."""
        return self.cfg.train.resident

    def trainer_args(self, layout: RunLayout, iteration: int, attempt: int, rank: int,
                     launch: str | None = None) -> list[str]:
        """What `torchrun ... -m train.trainer` gets at phase 10: for a resident trainer the run
        folder, job and node whose orders it serves (launched as `launch`); else the iteration's plan."""
        if self.resident_trainer:
            return ["--resident", launch or "LAUNCH", "--log-path", str(layout.root), "--job", self.args.job,
                    "--for-node", str(rank)]
        return ["--plan", str(layout.training_plan(iteration)), "--attempt", str(attempt)]

    def torchrun_argv(self, layout: RunLayout, iteration: int, attempt: int, rank: int, *, endpoint: str,
                      rdzv_id: str, is_host: bool, local_addr: str) -> list[str]:
        """The phase-10 command of one node (the driver runs it, --dry-run shows it)."""
        return torchrun_command(
            python=sys.executable, nnodes=self.args.num_nodes, node_rank=rank,
            nproc_per_node=self.cfg.train.nproc_per_node, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
            is_host=is_host, local_addr=local_addr, module="train.trainer",
            args=self.trainer_args(layout, iteration, attempt, rank, launch=rdzv_id),
            join_timeout=int(self.cfg.train.collective_timeout))

    # -- which phases run in an iteration (docs/design.md §6): RUNS_WHEN names the condition ------
    def trains_in(self, it: int) -> bool:
        """Every iteration but the evaluation-only one that measures the final checkpoint."""
        return not self.is_final_eval(it)

    def rolls_out_in(self, it: int) -> bool:
        return self.kind.rolls_out and self.trains_in(it)

    def evaluates_in(self, it: int) -> bool:
        return self.kind.evaluates and self.is_eval(it)

    def runs(self, phase: int, it: int) -> bool:
        """Whether `phase` of this job's table runs in iteration `it` (the driver and the dry run ask)."""
        condition = RUNS_WHEN.get(phase)
        return phase in self.kind.phases and (condition is None or getattr(self, condition)(it))

    def is_final_eval(self, it: int) -> bool:
        return self.final_eval_on and it == self.cfg.run.max_iterations + 1

    def is_eval(self, it: int) -> bool:
        k = self.cfg.run.eval_interval
        return k > 0 and ((it - 1) % k == 0 or self.is_final_eval(it))

    def _task_file(self, split: str) -> Path:
        return Path(self.cfg.run.data_path) / (self.cfg.tasks.train_file if split == "train" else self.cfg.tasks.eval_file)

    def pool(self, split: str) -> list:
        if split not in self._pools:
            name = self.cfg.tasks.train_file if split == "train" else self.cfg.tasks.eval_file
            path = self._task_file(split)
            if not path.exists():
                raise ConfigError(f"{split} task file {path} does not exist: --data-path must hold {name} "
                                  f"(or set tasks.{split}_file); make one with `python -m rollout.tasks make`")
            self._pools[split] = load_tasks(path)
        return self._pools[split]

    def check_inputs(self) -> None:
        """Before this node writes anything to the run folder (docs/design.md §5 rule 10): every
        task file this job reads parses (all lines, UTF-8), the reward loads and returns a finite
        number on a sample task within tasks.reward_timeout, the environment (tasks.env) loads and
        gives its first messages on a sample task within rollout.env_step_timeout, secret
        references resolve, and the starting model fits the inputs (rl/model_inputs.py). ConfigError (exit 2) names the file
        and line, the reward, the key or the task."""
        kind = self.kind
        splits = (["train"] if kind.rolls_out else []) + \
            (["eval"] if kind.only_evaluates or (kind.evaluates and self.cfg.run.eval_interval > 0) else [])
        try:
            pools = [self.pool(split) for split in splits]
            if pools:
                check_reward(self.cfg.tasks.reward, pools[0][0], self.cfg.tasks.reward_timeout)
            if pools and self.cfg.tasks.env:
                check_env(self.cfg.tasks.env, pools[0][0], self.cfg.rollout.env_step_timeout)
        except (TaskFileError, RewardError, EnvError) as exc:
            raise ConfigError(str(exc)) from None
        for split in splits:   # enough tasks for tasks_per_iteration / eval_tasks: the sampler's own check
            try:
                self.tasks_of(split, 1)
            except ValueError as exc:
                raise ConfigError(f"{exc} ({self._task_file(split)})") from None
        if kind.serves and self.cfg.inference.engine == "vllm":
            self.cfg.inference.vllm.resolved_api_key()  # an unset env: or unreadable file: is found now
            self.cfg.inference.vllm.resolved_env()
        if kind.serves:
            check_model_inputs(self.cfg, {split: (self.pool(split), self._task_file(split)) for split in splits})

    def tasks_of(self, split: str, iteration: int) -> list:
        if split == "train":
            return sample_iteration(self.pool("train"), self.cfg.tasks.tasks_per_iteration,
                                    seed=self.cfg.rollout.seed, iteration=iteration)
        return select_eval(self.pool("eval"), self.cfg.tasks.eval_tasks, seed=self.cfg.rollout.seed)

    def shares(self, split: str, iteration: int) -> list[list]:
        return split_plan(self.tasks_of(split, iteration), self.args.rank_weights)


P = PhaseId
# The condition (a RunPlan method of the iteration) under which each phase runs; phases not
# listed (0 sync and 13 iteration-done) run in every iteration of a job that has them.
RUNS_WHEN: dict[int, str] = {
    P.TRAIN_ROLLOUT: "rolls_out_in",
    P.TRAIN_ROLLOUT_DONE: "rolls_out_in",
    P.AGGREGATE_TRAIN: "rolls_out_in",
    P.TRAIN_FILES_READY: "rolls_out_in",
    P.EVAL: "evaluates_in",
    P.AGGREGATE_EVAL: "evaluates_in",
    P.STOP_INFERENCE: "trains_in",
    P.PREPARE_TRAINING_DATA: "trains_in",
    P.TRAINING_READY: "trains_in",
    P.TRAIN: "trains_in",
    P.PUBLISH_CHECKPOINT: "trains_in",
    P.RESTART_INFERENCE: "trains_in",
}


class BenchPlan(RunPlan):
    """`run.sh --bench`: one iteration whose phase-10 torchrun runs the trainer's benchmark."""

    @property
    def final_eval_on(self) -> bool:
        return False

    @property
    def last_iteration(self) -> int:
        return 1

    @property
    def resident_trainer(self) -> bool:
        return False  # one torchrun runs the benchmark and exits

    def trainer_args(self, layout: RunLayout, iteration: int, attempt: int, rank: int,
                     launch: str | None = None) -> list[str]:
        """The benchmark options, this run's `train` section (as a YAML file) and model."""
        job = layout.job("bench")
        out = ["--bench", "--config", str(job.bench_config(rank))]
        if self.cfg.model.path:
            out += ["--model", self.cfg.model.path]  # else the trainer writes the tiny model (the same on every node)
        opts = {**self.args.bench, "bench_output_json": self.args.bench["bench_output_json"] or job.bench_json}
        for key, value in opts.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value not in (None, False):
                out += [flag, str(value)]
        return out


def make_plan(args: RunArgs, cfg: RunConfig) -> RunPlan:
    return BenchPlan(args, cfg) if args.bench is not None else RunPlan(args, cfg)
