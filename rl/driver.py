"""The RL phase table (docs/design.md §6): it binds the actions of rollout/ and train/ to the
protocol's phases (docs/design.md §3: rl/ is the top layer).

`run_node(args)` joins the job, builds the table for its `--rl-phase` and hands it to the
generic `PhaseRunner`. Every action is idempotent: a phase redone after a crash finds its
outputs (chunks, all.parquet, plan, checkpoint) and finishes without repeating work.
"""
from __future__ import annotations

import json
import logging
import re
import signal
from pathlib import Path

import yaml

from coordination import exits, log as blog, metrics, sinks
from coordination.barrier import Arrival, Barrier
from coordination.checkpoints import apply_retention, is_complete, publish_checkpoint, read_latest
from coordination.children import run_watched
from coordination.config import to_dict
from coordination.join import join_job
from coordination.layout import RunLayout, check_no_links
from coordination.node import Node
from coordination.phases import BY_NUMBER, PhaseId
from coordination.progress import Progress
from coordination.records import ensure_dir, open_own, publish_bytes, publish_record
from coordination.runner import Phase, PhaseRunner, Step, Verdict, default_decide, failure_summary
from rl.args import RunArgs
from rl.payloads import (EvalChoice, EvalResult, IterationSummary, Rendezvous, RolloutDone, SyncGo, TrainAggregated,
                         Trained)
from rl.pipeline import wait_for_checkpoint, wait_for_rollouts
from rl.plan import RUNS_WHEN, RunPlan, job_plan
from rl.runconfig import RunConfig
from rl.serving import EngineLifecycle
from rl.training import TrainerLifecycle
from rollout.envs import load_env
from rollout.judge.engine import open_judge
from rollout.rewards import load_reward
from rollout.scoring import Scoring
from train.benchmark import render_table

log = logging.getLogger("baton.driver")


class AttemptFailed(RuntimeError):
    """This node's training attempt failed on another rank, or before this process ran it. Not a
    ChildFailed: the words it quotes (a full disk, say) are another process's report, no cause for
    this node to stop (coordination/exhaustion.py reads only a child's own words)."""


class StepProgress:
    """Training progress on this node's console while torchrun writes to trainer.log: a rich bar
    on a terminal, periodic log lines otherwise, fed by the trainer's "step k/K" lines."""

    _STEP = re.compile(r" step (\d+)/(\d+) ")

    def __init__(self, log_file: Path, description: str, node: Node):
        self.log_file, self.description, self.node = log_file, description, node
        self.offset = log_file.stat().st_size if log_file.exists() else 0
        self.bar: Progress | None = None
        self.done = 0

    def update(self) -> None:
        try:
            with open_own(self.log_file, "rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return
        text = chunk.decode(errors="replace")
        complete = text.rfind("\n") + 1  # keep a half-written last line for the next look
        self.offset += len(text[:complete].encode())
        for m in self._STEP.finditer(text[:complete]):
            k, total = int(m.group(1)), int(m.group(2))
            if self.bar is None:
                self.bar = Progress(self.description, total=total, unit="steps").__enter__()
            if k > self.done:
                self.bar.advance(k - self.done)
                self.done = k
                self.node.say(f"{self.description}: step {k}/{total}")

    def close(self) -> None:
        self.update()
        if self.bar is not None:
            self.bar.close()


class RLJob:
    """One node's view of an RL job: the actions of its phases and the table that binds them.
    What the job does (train, evaluate, serve, wait) is data: `self.kind` (rl/jobs.py)."""

    def __init__(self, args: RunArgs, cfg: RunConfig, node: Node, plan: RunPlan | None = None):
        self.args, self.cfg, self.node = args, cfg, node
        self.plan = plan or job_plan(args, cfg)
        self.kind = self.plan.kind
        self.layout: RunLayout = node.layout
        self._tokenizer = None
        self._reward = None
        self.trainers = TrainerLifecycle(node, self.plan, beside_engine=self.kind.serves)
        self.engines = EngineLifecycle(cfg.inference, rank=node.rank, temperature=cfg.rollout.temperature,
                                       log_file=node.job.log_file(node.rank, "inference"), debug_mode=args.debug_mode,
                                       say=node.say, start_timeout=cfg.coordination.child_start_timeout)
        self.is_eval, self.is_final_eval = self.plan.is_eval, self.plan.is_final_eval
        self.shares = self.plan.shares

    # -- policies ------------------------------------------------------------------------------
    def policy(self, iteration: int) -> tuple[int, Path]:
        """Checkpoint `iteration` (the base model for 0); it must be complete."""
        if iteration == 0:
            return 0, Path(self.cfg.model.path)
        folder = self.layout.checkpoint(iteration)
        if not is_complete(folder, run_id=self.node.run_id):
            raise RuntimeError(f"checkpoint {folder} is missing or incomplete; it is needed as the policy of "
                               f"iteration {iteration + 1}")
        return iteration, folder

    def rollout_policy(self, step: Step) -> tuple[int, Path]:
        """A job that trains its own policy: checkpoint N-1. A job that waits for checkpoints: what
        the master chose at phase 0 (all ranks agree)."""
        if self.kind.waits_for != "checkpoint":
            return self.policy(step.iteration - 1)
        return self.policy(int(SyncGo.of(step).policy_iteration))

    # -- tasks -------------------------------------------------------------------------------
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.path)
        return self._tokenizer

    def reward(self):
        if self._reward is None:
            self._reward = load_reward(self.cfg.tasks.reward, self.cfg.tasks.reward_timeout)
        return self._reward

    # -- actions -------------------------------------------------------------------------------
    def roll_out(self, step: Step, split: str) -> dict:
        # rollout.worker, rollout.aggregate and train.data load pyarrow: imported when a phase
        # needs them, so dry runs and refused commands answer fast.
        from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for

        policy_it, path = self.rollout_policy(step)
        self.engines.ensure(policy_it, path)
        mine = self.shares(split, step.iteration)[self.node.rank]
        sampling, group = sampling_for(self.cfg.rollout, split)
        target = RolloutTarget(self.layout, split, step.iteration, self.node.rank, run_id=self.node.run_id,
                               generation=self.node.generation, policy_iteration=policy_it)
        # The judge's engine (if any) lives for this phase only: it never holds memory while training runs.
        judge = open_judge(self.cfg.tasks.judge, self.cfg.inference, rank=self.node.rank,
                           log_file=self.node.job.log_file(self.node.rank, "judge"),
                           start_timeout=self.cfg.coordination.child_start_timeout)
        try:
            sampler = Sampler(self.engines.engine, self.tokenizer(), self.cfg.rollout, self.reward(), sampling, group,
                              load_env(self.cfg.tasks.env) if self.cfg.tasks.env else None,
                              Scoring.of(self.cfg.tasks, judge))
            s = rollout_rank(target, sampler, mine, on_progress=lambda done, total, msg: self.node.say(msg),
                             fence=self.node.check_fence)
        finally:
            if judge is not None:
                judge.close()
        return RolloutDone(tasks=s.tasks, samples=s.samples, tokens=s.completion_tokens, seconds=round(s.seconds, 3),
                           policy_iteration=policy_it).to_dict()

    def aggregate(self, step: Step, split: str, barrier_phase: int, arrivals: dict[int, Arrival] | None = None) -> dict:
        from rollout.aggregate import aggregate  # pyarrow: see roll_out
        from rollout.worker import sampling_for

        gens = ({r: a.generation for r, a in arrivals.items()} if arrivals is not None
                else {int(r): a["generation"] for r, a in step.gos[barrier_phase].arrivals.items()})
        expected = {r: [t.id for t in share] for r, share in enumerate(self.shares(split, step.iteration))}
        _, group = sampling_for(self.cfg.rollout, split)
        return aggregate(self.layout, split, step.iteration, ranks=gens, run_id=self.node.run_id, expected=expected,
                         group_size=group, success_reward=self.cfg.rollout.success_reward,
                         generation=self.node.generation)

    def phase0(self, step: Step) -> dict:
        if self.kind.waits_for == "checkpoint" and self.node.is_master:
            need = step.iteration - 1 if self.kind.policy == "previous" else \
                max(0, step.iteration - 1 - self.cfg.run.max_staleness)
            wait_for_checkpoint(self, need)
        return self.trainers.ready() if self.plan.resident_trainer and self.kind.trains else {}

    def decide0(self, step: Step, arrivals: dict[int, Arrival]) -> Verdict:
        v = default_decide(step, arrivals)
        if v.decision != "continue":
            return v
        go = SyncGo()
        if self.kind.waits_for == "checkpoint":
            latest = read_latest(self.layout, run_id=self.node.run_id)
            chosen = latest[0] if latest else 0
            if self.kind.policy == "previous":
                chosen = step.iteration - 1  # evaluate exactly the checkpoint of the previous iteration
            go = SyncGo(policy_iteration=chosen)
        if (self.plan.resident_trainer and self.plan.runs(PhaseId.TRAIN, step.iteration)
                and self.trainers.common_launch(arrivals) is None and not self.already_trained(step.iteration)):
            go = SyncGo(go.policy_iteration, trainer=self.trainers.rendezvous(step.iteration, 1, early=True))
        return Verdict("continue", payload=go.to_dict())

    def start_trainer_early(self, step: Step) -> None:
        """Launch the resident trainer early if phase 0's GO asked for it (TrainerLifecycle.launch_early),
        with the model inputs of the iteration's policy for the model load that may overlap the rollouts."""
        def inputs() -> dict:
            from train.data import model_inputs  # pyarrow: see roll_out

            it, path = self.policy(step.iteration - 1)
            return model_inputs(self.cfg.train, iteration=step.iteration, input_checkpoint=path,
                                input_iteration=it, world_size=self.trainers.world_size)
        self.trainers.launch_early(step, inputs)

    def decide_eval_choice(self, step: Step, arrivals: dict[int, Arrival]) -> Verdict:
        v = default_decide(step, arrivals)
        return Verdict(v.decision, v.reason, EvalChoice(eval=self.is_eval(step.iteration)).to_dict())

    def decide_eval(self, step: Step, arrivals: dict[int, Arrival]) -> Verdict:
        v = default_decide(step, arrivals)
        if v.decision != "continue":
            return v
        try:
            stats = self.aggregate(step, "eval", PhaseId.AGGREGATE_EVAL, arrivals)
        except Exception as exc:  # noqa: BLE001 - a failed aggregation is the master's phase failing
            if exits.classify(exc) == exits.RESOURCE:
                raise  # not for the GO to abort: this node stops (exit 8) and resumes here once restarted
            log.exception("eval aggregation failed")
            return Verdict("abort", f"iteration {step.iteration} failed at phase 6 aggregate-eval: {exc}")
        acc = (stats.get("eval") or {}).get("accuracy")
        log.info("iteration %d eval accuracy %s over %s tasks", step.iteration,
                 f"{acc:.4f}" if acc is not None else "-", stats.get("tasks"))
        return Verdict("continue", payload=EvalResult(eval_accuracy=acc).to_dict())

    def stop_inference(self, step: Step) -> dict:
        if self.kind.waits_for == "rollouts":
            if self.node.is_master:
                wait_for_rollouts(self, step.iteration)
            return {}
        # Phase 12 serves the new checkpoint: other base weights, unless only adapters change.
        lora = self.cfg.train.lora
        self.engines.pause(new_weights=self.kind.trains and not (lora.rank and lora.publish == "adapters"))
        return {}

    def checkpoint_done(self, iteration: int) -> bool:
        return is_complete(self.layout.checkpoint(iteration), run_id=self.node.run_id)

    def prepare(self, step: Step) -> dict:
        from train.data import prepare_training_data  # pyarrow: see roll_out

        if self.checkpoint_done(step.iteration):
            return {"skipped": "checkpoint already published"}
        it, path = self.policy(step.iteration - 1)
        plan = prepare_training_data(self.layout, step.iteration, self.cfg.train, run_id=self.node.run_id,
                                     world_size=self.trainers.world_size,
                                     temperature=self.cfg.rollout.temperature, input_checkpoint=path,
                                     input_iteration=it)
        return {"plan": str(plan)}

    def decide_ready(self, step: Step, arrivals: dict[int, Arrival]) -> Verdict:
        v = default_decide(step, arrivals)
        if v.decision != "continue":
            return v
        if self.plan.resident_trainer:
            launch = self.trainers.common_launch(arrivals)
            if launch is not None:
                # Every node's trainer is alive and of one launch: they keep serving.
                return Verdict("continue", payload=Rendezvous(reuse=launch).to_dict())
        # A fresh rendezvous: the first training of this process, or a node without its trainer
        # (restarted, or its trainer died), so every node launches anew.
        return Verdict("continue", payload=self.trainers.rendezvous(step.iteration, 1))

    def _attempt_failed_elsewhere(self, step: Step) -> str | None:
        """An error another rank already reported for this attempt. A torchrun attempt needs every
        node: once one has given up (it died, or its trainer failed), launching or waiting here
        would only block until the rendezvous timeout, so this rank fails the attempt at once."""
        b = Barrier(self.node, step.iteration, 10, step.spec.name, step.attempt)
        for r in range(self.args.num_nodes):
            if r == self.node.rank:
                continue
            a = b.read_arrival(r)
            if a is not None and not a.ok:
                return f"attempt {step.attempt} already failed on rank {r}: {a.error}"
        return None

    def _attempt_watch(self, step: Step, progress: StepProgress):
        """What the driver checks while its trainer works: progress lines, and another rank's
        failure of this attempt (stop waiting at once)."""
        def tick() -> None:
            progress.update()
            failed = self._attempt_failed_elsewhere(step)
            if failed:
                raise AttemptFailed(f"stopped training: {failed}")
        return tick

    def already_trained(self, iteration: int) -> bool:
        """A rerun never trains twice: the iteration's checkpoint is published."""
        return self.checkpoint_done(iteration)

    def before_torchrun(self) -> None:
        """What the per-launch torchrun needs beside the plan (nothing for an RL job)."""

    def after_training(self) -> None:
        """Run by the master once every rank trained (nothing for an RL job)."""

    def train(self, step: Step) -> dict:
        if self.already_trained(step.iteration):
            return {"skipped": "checkpoint already published"}
        failed = self._attempt_failed_elsewhere(step)
        if failed:
            raise AttemptFailed(failed)
        before = self.trainers.failed_before(step)
        if before:
            raise AttemptFailed(before)
        rdzv = Rendezvous.for_attempt(step)
        if self.plan.resident_trainer:
            return self.train_resident(step, rdzv)
        self.before_torchrun()
        cmd, env = self.trainers.command(step, rdzv)

        log_file = self.trainers.log_file
        progress = StepProgress(log_file, f"train iter {step.iteration}", self.node)
        watch_attempt = self._attempt_watch(step, progress)
        self.node.say(f"training iteration {step.iteration} attempt {step.attempt}", beat=True)
        try:
            run_watched(cmd, env=env, log_file=log_file, node=self.node, peers=range(self.args.num_nodes),
                        on_tick=watch_attempt, what=f"torchrun (iteration {step.iteration}, attempt {step.attempt})")
        finally:
            progress.close()
        return Trained(step.attempt).to_dict()

    def train_resident(self, step: Step, rdzv: Rendezvous) -> dict:
        """Phase 10 with a resident trainer: order this iteration's training (launching the trainer
        if the GO asks for a fresh rendezvous) and wait for every trainer rank's result record."""
        self.trainers.order(step, rdzv)
        progress = StepProgress(self.trainers.log_file, f"train iter {step.iteration}", self.node)
        tick = self._attempt_watch(step, progress)
        self.node.say(f"training iteration {step.iteration} attempt {step.attempt}", beat=True)
        try:
            self.trainers.results(step, on_tick=tick)
        finally:
            progress.close()
        return Trained(step.attempt).to_dict()

    def decide_train(self, step: Step, arrivals: dict[int, Arrival]) -> Verdict:
        failed = {r: a for r, a in arrivals.items() if not a.ok}
        if not failed:
            self.after_training()
            return Verdict("continue", payload=Trained(step.attempt).to_dict())
        # Always "retry": the runner turns it into an abort once train.max_attempts are used.
        return Verdict("retry", failure_summary(step, failed),
                       self.trainers.rendezvous(step.iteration, step.attempt + 1))

    def publish(self, step: Step) -> dict:
        attempt = Trained.of(step).attempt
        publish_checkpoint(self.layout, step.iteration, self.layout.checkpoint_staging(step.iteration, attempt),
                           run_id=self.node.run_id)
        # iteration i evaluates checkpoint i - 1: keep every checkpoint an eval iteration measures
        evals = {i - 1 for i in range(1, step.iteration + 2) if self.plan.is_eval(i)}
        removed = apply_retention(self.layout, keep_last=self.cfg.train.keep_last,
                                  protected=evals | {step.iteration, 0})
        return {"removed": removed}

    def restart_inference(self, step: Step) -> dict:
        """Serve the new checkpoint for the next iteration (restart, reload or wake)."""
        if not (self.kind.serves and self.kind.trains) or step.iteration + 1 > self.plan.last_iteration:
            return {}  # no engine in this job, or the run ends with this iteration
        if not self.node.is_master:
            # Phase 11 (the master's) publishes; phase 12 has no barrier before it.
            self.node.wait_for(lambda: True if self.checkpoint_done(step.iteration) else None,
                               what=f"the master to publish checkpoint {step.iteration}", peers=lambda: [0],
                               dirs=[self.layout.checkpoints_dir])
        self.trainers.check_released(step.iteration)
        self.engines.resume(*self.policy(step.iteration))
        return {}

    def decide_done(self, step: Step, arrivals: dict[int, Arrival]) -> Verdict:
        v = default_decide(step, arrivals)
        if v.decision != "continue":
            return v
        train = PhaseId.TRAIN
        train_attempt = Trained.of(step).attempt if train in step.gos else None
        rec = metrics.build(self.layout, self.node.job, run_id=self.node.run_id, iteration=step.iteration,
                            num_nodes=self.args.num_nodes, policy_iteration=step.iteration - 1,
                            train_attempt=train_attempt, eval_done=EvalChoice.of(step).eval
                            or self.is_final_eval(step.iteration))
        publish_record(self.layout.metrics(step.iteration), "metrics", rec, run_id=self.node.run_id,
                       generation=self.node.generation)
        sinks.emit(self.cfg.logging, self.layout, rec)
        return Verdict("continue", payload=IterationSummary(train_reward_mean=rec.get("train_reward_mean"),
                                                            eval_accuracy=rec.get("eval_accuracy"),
                                                            loss=rec.get("loss")).to_dict())

    # -- the table (docs/design.md §6): which phases run is RunPlan.runs (rl/plan.py, RUNS_WHEN) --
    def phases(self) -> list[Phase]:
        P, spec = PhaseId, BY_NUMBER
        table = {
            P.SYNC: Phase(spec[P.SYNC], self.phase0, self.decide0),
            P.TRAIN_ROLLOUT: Phase(spec[P.TRAIN_ROLLOUT], lambda s: self.roll_out(s, "train")),
            P.TRAIN_ROLLOUT_DONE: Phase(spec[P.TRAIN_ROLLOUT_DONE]),
            P.AGGREGATE_TRAIN: Phase(spec[P.AGGREGATE_TRAIN], self.aggregate_train),
            P.TRAIN_FILES_READY: Phase(spec[P.TRAIN_FILES_READY], decide=self.decide_eval_choice),
            P.EVAL: Phase(spec[P.EVAL], lambda s: self.roll_out(s, "eval")),
            P.AGGREGATE_EVAL: Phase(spec[P.AGGREGATE_EVAL], decide=self.decide_eval),
            P.STOP_INFERENCE: Phase(spec[P.STOP_INFERENCE], self.stop_inference),
            P.PREPARE_TRAINING_DATA: Phase(spec[P.PREPARE_TRAINING_DATA], self.prepare),
            P.TRAINING_READY: Phase(spec[P.TRAINING_READY], lambda s: self.trainers.ready(), self.decide_ready),
            P.TRAIN: Phase(spec[P.TRAIN], self.train, self.decide_train, max_attempts=self.cfg.train.max_attempts,
                  attempts_key="train.max_attempts"),
            P.PUBLISH_CHECKPOINT: Phase(spec[P.PUBLISH_CHECKPOINT], self.publish),
            P.RESTART_INFERENCE: Phase(spec[P.RESTART_INFERENCE], self.restart_inference),
            P.ITERATION_DONE: Phase(spec[P.ITERATION_DONE], decide=self.decide_done),
        }
        return [self._when(table[n]) for n in self.kind.phases]

    def _when(self, phase: Phase) -> Phase:
        """`phase`, running in the iterations its RUNS_WHEN condition names; every action after
        phase 0 first launches the trainer early if phase 0's GO asked for it (once)."""
        number = phase.spec.number
        if number in RUNS_WHEN:
            phase.enabled = lambda s: self.plan.runs(number, s.iteration)
        if phase.action is not None and number != PhaseId.SYNC:
            action = phase.action

            def act(step: Step, action=action):
                self.start_trainer_early(step)
                return action(step)
            phase.action = act
        return phase

    def aggregate_train(self, step: Step) -> dict:
        return TrainAggregated.brief(self.aggregate(step, "train", PhaseId.TRAIN_ROLLOUT_DONE)).to_dict()

    def finished_reason(self) -> str:
        return f"run.max_iterations ({self.cfg.run.max_iterations}) reached" + (
            ", final checkpoint evaluated" if self.plan.final_eval_on else "")


class BenchJob(RLJob):
    """`run.sh --bench`: no RL, one iteration of join (phase 0), rendezvous (9) and one torchrun of
    the trainer's benchmark (10); the plan (rl/plan.py BenchPlan) gives torchrun its options."""

    def phases(self) -> list[Phase]:
        P, spec = PhaseId, BY_NUMBER
        return [self._when(p) for p in (
            Phase(spec[P.SYNC], self.phase0, self.decide0), Phase(spec[P.TRAINING_READY], decide=self.decide_ready),
            Phase(spec[P.TRAIN], self.train, self.decide_train, max_attempts=self.cfg.train.max_attempts,
                  attempts_key="train.max_attempts"))]

    def finished_reason(self) -> str:
        return (f"benchmark done: results in {self.args.bench['bench_output_json'] or self.node.job.bench_json} "
                f"(the master's console shows the table)")

    def already_trained(self, iteration: int) -> bool:
        return False  # a benchmark publishes no checkpoint

    def before_torchrun(self) -> None:
        """The trainer's --bench reads this run's `train` section from a YAML file (--config)."""
        target = self.node.job.bench_config(self.node.rank)
        ensure_dir(target.parent)
        publish_bytes(target, yaml.safe_dump({"train": to_dict(self.cfg.train)}, sort_keys=False).encode())

    def after_training(self) -> None:
        self.show_bench()

    def show_bench(self) -> None:
        """Print the benchmark's table on the master's console: every torchrun has exited (this is
        the barrier's decision), so the trainer's rank 0, on whichever node, has written the JSON."""
        from rich.console import Console  # rich's console: only the bench master prints a table

        path = Path(self.args.bench["bench_output_json"] or self.node.job.bench_json)
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"the benchmark finished but its results {path} cannot be read: {exc}") from None
        Console(width=160).print(render_table(report))
        log.info("benchmark results: %s", path)



def _stop_requested(layout: RunLayout):
    def check() -> str | None:
        # A STOP that is a link was planted (stop.sh writes a plain file): it is refused with the
        # link named, not followed to whatever file it points at.
        check_no_links(layout.stop_file)
        return f"a stop was requested ({layout.stop_file})" if layout.stop_file.exists() else None
    return check


def _say_iteration_done(iteration: int, go, seconds: float) -> None:
    """One console line per finished iteration with the numbers people watch (from the GO of the
    iteration's last barrier, so every node prints the same)."""
    p = IterationSummary.from_dict(go.payload).to_dict()
    shown = (("train_reward_mean", "train reward", ""),
             ("eval_accuracy", "eval accuracy", f" (checkpoint {iteration - 1})"), ("loss", "loss", ""))
    parts = [f"{label} {p[key]:.3f}{note}" for key, label, note in shown if isinstance(p.get(key), (int, float))]
    log.info("iteration %d done in %.1f s%s", iteration, seconds, (": " + ", ".join(parts)) if parts else "")


def run_node(args: RunArgs, cfg: RunConfig) -> int:
    """Everything one `scripts/run.sh` invocation does; returns the process exit code."""
    logger = blog.setup(f"{args.kind.name} rank{args.rank}")
    layout = RunLayout(args.log_path)
    node = None
    job: RLJob | None = None
    code, final_message = exits.OK, "finished"

    def on_term(signum, frame):  # turn SIGTERM into a clean unwinding (engines and torchrun stopped)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        plan = job_plan(args, cfg)
        node = join_job(layout, job=args.kind.name, rank=args.rank, num_nodes=args.num_nodes,
                        job_facts={"rank_weights": args.rank_weights, "rl_phase": args.kind.rl_phase,
                                   "rollout_split": args.kind.rollout_split},
                        config=to_dict(cfg), cfg=cfg.coordination, resume=args.resume, command=args.command)
        logfile = node.job.log_file(args.rank, "driver")
        blog.setup(f"{args.kind.name} rank{args.rank} gen{node.generation}", logfile, getattr(logging, cfg.logging.level))
        logger.info("logs of this rank: %s (driver), %s (inference), %s (trainer)", logfile,
                    node.job.log_file(args.rank, "inference"), node.job.log_file(args.rank, "trainer"))
        job = (BenchJob if args.kind.benchmarks else RLJob)(args, cfg, node, plan)
        if node.is_master and not args.kind.benchmarks:
            sinks.start(cfg.logging, layout)  # W&B / TensorBoard open in the background, off every phase
        runner = PhaseRunner(node, job.phases(), max_iterations=job.plan.last_iteration,
                             stop_requested=_stop_requested(layout),
                             gc_keep_iterations=cfg.coordination.gc_keep_iterations,
                             finished_reason=job.finished_reason(),
                             on_iteration_end=_say_iteration_done)
        outcome = runner.run()
        final_message = f"finished: {outcome.stopped}"
        logger.info("%s (%d iterations run by this process)", final_message, outcome.iterations_run)
    except KeyboardInterrupt as exc:
        code, final_message = 130, f"interrupted ({exc})"
        logger.error("interrupted; stopping this node (restart it with the same command to resume)")
    except Exception as exc:  # noqa: BLE001 - every ending gets a distinct code and one clear message
        code = exits.classify(exc)
        final_message = f"stopped: {exits.message(exc, str(layout.root))}"
        if code == exits.RESOURCE:
            # The traceback only in the log (if it can still be written); the console's one line
            # comes last, after what stopping the children and the engine says.
            logger.error("%s; the traceback:", final_message, exc_info=True, extra=blog.FILE_ONLY)
        else:
            logger.error("%s", exc, exc_info=code == exits.ERROR)
    finally:
        if job is not None:
            try:
                job.trainers.close(finished=code == exits.OK)
            except Exception as exc:  # noqa: BLE001 - still stop the engine and release the claim
                logger.error("could not stop the resident trainer: %s", exc)
            try:
                job.engines.close()
            except Exception as exc:  # noqa: BLE001 - still release the claim
                logger.error("could not stop the inference engine: %s", exc)
        try:
            sinks.close()
        except Exception as exc:  # noqa: BLE001 - metrics sinks must not hide the run's own outcome
            logger.warning("could not close the metric sinks: %s", exc)
        if node is not None:
            fenced = node.claim is not None and node.claim.is_fenced(probe=False)
            if not fenced:
                node.close("exited" if code == exits.OK else "failed", final_message[:300])
        if code == exits.RESOURCE:
            logger.error("%s", final_message)
    return code
