"""Phase 10: `torchrun ... -m train.trainer --plan PLAN --attempt A` (or plain `python -m` for one
process), or, with train.resident, `torchrun ... -m train.trainer --resident LAUNCH ...`, which
serves one such plan per order of its driver (train/resident.py, docs/design.md §9.6).

`python -m train.trainer --bench [train key=value ...]` benchmarks a training step on fake data
instead (train/benchmark.py), with any levers set by the overrides, e.g. `ac.freq=1 lora.rank=8`.

Every rank reads the plan, its own shard, the input checkpoint the plan pins and, when present,
its optimizer state; trains the plan's steps; writes its share of the checkpoint into the
attempt's staging folder (rank 0 the completeness marker, last), then its result record. Phase
11 alone publishes the staging folder as checkpoints/iter-N. If any rank fails, every rank exits
non-zero and no complete staging folder exists. If iter-N is already published, the trainer
exits 0 at once (a rerun never trains twice).

torch, transformers and pyarrow (train.build, train.data, ...) are imported inside the functions
that train, so `--help` and usage errors answer before they load.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import click

from coordination import log
from coordination.checkpoints import UNREPAIRABLE, CheckpointError, is_complete, mark_complete, optimizer_pending, publish_optimizer
from coordination.clock import Backoff
from coordination.config import ConfigError, from_dict
from coordination.layout import RunLayout
from coordination.records import read_record, restrict_umask
from train.benchmark import bench_model, bench_options, print_and_write, run_bench as run_benchmark, train_config_from
from train.launch import exit_now
from train.config import TrainConfig
from train.resident import Mailbox, watch_driver
from train.results import summarise, write_result

_log = logging.getLogger("baton.train.trainer")


def _seed(seed: int, iteration: int) -> int:
    return (int(seed) * 1_000_003 + int(iteration)) % (2**63)


@dataclass
class Held:
    """What a trainer holds between iterations: the (sharded) model, its optimizer and state, the
    reference model, the optimizer step count. A resident trainer (train.resident) keeps one across
    iterations; the per-iteration trainer builds one and exits."""

    cfg: Any                   # train.config.TrainConfig of the plan that built it
    config: dict[str, Any]     # that plan's `config` section: a plan with another one needs a rebuild
    t: Any                     # train.build.Trainable
    reference: Any
    opt_step: int
    pad_id: int
    iteration: int             # the checkpoint iteration the weights are (the next plan's input)
    offload: Any = None        # train.offload.ResidentOffload once created
    pending: Any = None        # train.optim_state.OptimizerWrite of the last iteration, until settled

    def tear_down(self, device) -> int:
        """Free everything this holds, before another model is built: one model at a time
        (docs/design.md §9.6). Dropping a Held frees nothing until a garbage collection, since FSDP2's
        modules hold reference cycles (module -> hooks -> FSDP state -> module), so the next load would
        hold two models' parameters and optimizer state. The storages of the parameters, gradients,
        buffers and optimizer state are freed outright (train.offload.free_storages), whatever still
        refers to them; an offload's host copies and the optimizer-state offload's hooks are dropped;
        a collection then takes the cycles' other objects (FSDP2's unsharded buffers among them) and
        the allocators give their caches back. The Held holds nothing afterwards. Returns the bytes
        freed (on `device`, and the offload's host copies)."""
        import gc

        import torch

        from train.offload import free_storages

        if self.pending is not None:
            raise RuntimeError("the optimizer state is still being written from this model; settle the write "
                               "(settle_optimizer_write) before tearing the model down")
        if self.t is None:
            return 0
        freed = self.offload.discard() if self.offload is not None else 0
        if self.t.optimizer_offload is not None:
            self.t.optimizer_offload.remove()
        freed += free_storages([self.t.model, self.reference], self.t.optimizer, device)
        self.t, self.reference, self.offload = None, None, None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            # The caching host allocator keeps freed pinned blocks (offload copies, optimizer-state
            # offload) for reuse; only this call gives them back to the system.
            torch._C._host_emptyCache()
        return freed


def load_held(plan: dict[str, Any], cfg, info) -> Held:
    """Collective: load the plan's input checkpoint and, when present, its optimizer state, then
    apply the levers and the parallelism."""
    import torch

    from train.build import load_model, load_reference, make_reference, make_trainable, preflight
    from train.distributed import agreed
    from train.export import read_trainer_state
    from train.optim_state import load_optimizer_state

    agreed("checking the trainer settings", info, lambda: preflight(cfg, info))
    torch.manual_seed(_seed(plan["seed"], plan["iteration"]))
    source = Path(plan["input_checkpoint"])
    use_ref = cfg.kl_coef > 0

    def load_inputs():
        # A checkpoint of this run is checked file by file before a byte is loaded (links, second
        # names, every safetensors file's run and iteration); the base model is the user's.
        if int(plan["input_iteration"]) > 0 and not is_complete(source, run_id=plan["run_id"]):
            raise CheckpointError(f"the input checkpoint {source} is missing or incomplete: {UNREPAIRABLE}")
        ref = load_reference(cfg, Path(plan["reference_model"])) if use_ref else None
        state = read_trainer_state(source)
        return load_model(cfg, source, state), state, ref

    loaded, state, ref = agreed("loading the input checkpoint", info, load_inputs)
    t = make_trainable(loaded, cfg, info)
    reference = make_reference(ref, cfg, info, t.dtype) if ref is not None else None
    resumed = state is not None and bool(state.get("has_optimizer_state")) and t.weights.resume_optimizer
    master = False
    if resumed:
        # collective (DCP); resharded to this world size
        _, master = load_optimizer_state(source, t.optimizer, t.policy)
        if t.optimizer_offload is not None:
            t.optimizer_offload.to_host()
    opt_step = int(state["optimizer_step"]) if resumed else 0
    _log.info("rank %d/%d on %s (%s, %s): loaded %s (iteration %d, optimizer step %d%s): %s", info.rank,
              info.world_size, info.device, cfg.backend, str(t.dtype).removeprefix("torch."), source,
              plan["input_iteration"], opt_step, "" if resumed else ", fresh optimizer",
              "the trained parameters continue from their float32 state" if master else
              "the weights continue from the published files" + ("" if int(plan["input_iteration"]) == 0 else
                                                                 " (the checkpoint holds no float32 state)"))
    pad_id = loaded.lm.config.pad_token_id if loaded.lm.config.pad_token_id is not None else 0
    return Held(cfg, plan["config"], t, reference, opt_step, pad_id, int(plan["input_iteration"]))


def train_steps(held: Held, plan: dict[str, Any], layout, iteration: int, info) -> list[dict[str, Any]]:
    """Collective: the plan's optimizer steps on `held`, seeded as every mode seeds them (so a
    resident trainer, a per-iteration one and a replay compute the same numbers)."""
    import torch

    from train.batches import collate, read_shard
    from train.distributed import agreed
    from train.optim import config_lr
    from train.step import StepSettings, train_step

    cfg, t = held.cfg, held.t
    steps = plan["steps"]
    torch.manual_seed(_seed(plan["seed"], iteration))  # the same seed whether the trainer was resident or not

    def load_shard():
        if not steps:
            return {}
        entry = plan["shards"][info.rank]
        return read_shard(layout.training_dir(iteration) / entry["file"], entry["sha256"])

    shard = agreed("loading the training shard", info, load_shard)
    settings = StepSettings(algorithm=cfg.algorithm, backend=cfg.backend, dtype=t.dtype,
                            temperature=plan["temperature"] if plan["temperature"] > 0 else 1.0,
                            clip_low=cfg.clip_low, clip_high=cfg.clip_high, kl_coef=cfg.kl_coef,
                            grad_clip=cfg.grad_clip)
    t.model.train()
    history = []
    for s, step in enumerate(steps):
        micro_batches = [collate(shard.get((s, m), []), held.pad_id) for m in range(step["micro_batches_per_rank"])]
        metrics = train_step(t.model, t.params, t.optimizer, micro_batches, lr=config_lr(cfg, held.opt_step),
                             global_completion_tokens=step["completion_tokens"], settings=settings, info=info,
                             reference=held.reference, router_loss=t.router_loss)
        held.opt_step += 1
        history.append(metrics.as_dict())
        if info.is_main:
            _log.info(metrics.line(f"iter {iteration} step {s + 1}/{len(steps)} (optimizer step {held.opt_step})"))
    return history


def train_iteration(held: Held, plan: dict[str, Any], layout, iteration: int, attempt: int, info, *,
                    defer_optimizer: bool = False, release: Callable[[], dict[str, Any]] | None = None
                    ) -> dict[str, Any]:
    """Collective: train the plan's steps on `held`, write the complete checkpoint folder into the
    attempt's staging folder, then this rank's result record (so every result means "staged").
    Publication (rename into checkpoints/, LATEST) is phase 11's. With `defer_optimizer` the folder
    holds the weights alone and `held.pending` becomes the optimizer state's write
    (start_optimizer_write, which copies the state to host memory before it returns). `release`
    (a resident trainer whose engine shares its devices) then hands the device memory back, and
    only after it is the result written, so "staged" also means "released": the engine that phase
    12 wakes or starts never meets the trainer's memory (docs/design.md §9.6). Its facts join the
    result. Returns the result's data."""
    from train.distributed import agreed
    from train.export import prepare_output_dir, save_checkpoint

    started = time.monotonic()
    cfg, t = held.cfg, held.t
    run_id = plan["run_id"]
    staging = layout.checkpoint_staging(iteration, attempt)
    if not plan["steps"]:
        _log.info("the plan has no steps (%s): republishing the input weights as iteration %d",
                  plan.get("zero_steps_reason"), iteration)
    agreed("preparing the staging folder", info, lambda: prepare_output_dir(staging, info))
    history = train_steps(held, plan, layout, iteration, info)
    source = Path(plan["input_checkpoint"])
    has_state = save_checkpoint(
        staging, policy=t.policy, optimizer=t.optimizer, info=info, backend=cfg.backend, run_id=run_id,
        iteration=iteration, tokenizer_source=source,
        trainer_state={"optimizer_step": held.opt_step, "iteration": iteration, "algorithm": cfg.algorithm,
                       "input_checkpoint": str(source), "input_iteration": plan["input_iteration"]},
        lora=cfg.lora, lora_record=t.weights.record, defer_optimizer=defer_optimizer)
    held.iteration = iteration
    if defer_optimizer and has_state:
        held.pending = start_optimizer_write(held, layout, iteration, attempt, info, run_id)
    released = release() if release is not None else {}
    data = {"ok": True, "world_size": info.world_size, "pid": os.getpid(), "steps": history, "optimizer_step": held.opt_step,
            "summary": summarise(history, plan, time.monotonic() - started), **released}
    write_result(layout, iteration, attempt, info.rank, run_id, data)
    if info.is_main:
        _log.info("staged %s (optimizer step %d) in %.1f s", staging, held.opt_step, time.monotonic() - started)
    return data


_write_group = None  # the gloo group of background optimizer writes (one per process, made collectively)


def start_optimizer_write(held: Held, layout, iteration: int, attempt: int, info, run_id: str):
    """Collective: start writing `held`'s optimizer state for checkpoint `iteration` in the
    background (train.optim_state.OptimizerWrite); rank 0 then marks the folder complete and, once
    phase 11 has published iter-N, renames it to iter-N/optimizer. Returns the write."""
    import torch.distributed as dist

    from coordination.checkpoint_files import Stamp
    from train.distributed import agreed
    from train.export import prepare_output_dir
    from train.optim_state import OptimizerWrite

    global _write_group
    if _write_group is None:
        # Its own group: the write's collectives run on a thread while the main thread may use the
        # default group, and DCP's asynchronous save needs a CPU backend (gloo) even on CUDA.
        _write_group = dist.new_group(backend="gloo")
    folder = layout.optimizer_staging(iteration, attempt)
    agreed("preparing the optimizer staging folder", info, lambda: prepare_output_dir(folder, info))
    started = time.monotonic()

    def finish(files: list[str]) -> None:
        if not info.is_main:
            return
        hold = os.environ.get("BATON_TEST_HOLD_OPTIMIZER_WRITE", "")  # tests: "N:S" holds iteration N's S seconds
        if hold and attempt > 0 and int(hold.split(":")[0]) == iteration:
            time.sleep(float(hold.split(":")[1]))
        mark_complete(folder, iteration=iteration, run_id=run_id, expected=files)
        written = time.monotonic() - started
        backoff = Backoff(0.02, 0.5)
        while not is_complete(layout.checkpoint(iteration), run_id=run_id):  # phase 11 publishes the weights
            time.sleep(backoff.next())
        publish_optimizer(layout, iteration, folder, run_id=run_id)
        _log.info("optimizer state of iteration %d written in %.2f s in the background, in place %.2f s after "
                  "the weights were staged", iteration, written, time.monotonic() - started)

    return OptimizerWrite(folder, held.t.policy, held.t.optimizer, group=_write_group, rank=info.rank,
                          world_size=info.world_size, stamp=Stamp(run_id, iteration), finish=finish)


def settle_optimizer_write(held: Held | None, timeout: float) -> None:
    """Wait for the optimizer state `held` is writing in the background (the next training step
    must not start before it is on disk, docs/design.md §9.6); raises what the write raised."""
    if held is None or held.pending is None:
        return
    pending, held.pending = held.pending, None
    pending.wait(timeout)


def train(plan: dict[str, Any], layout, iteration: int, attempt: int, info) -> None:
    """The per-iteration trainer (train.resident=false): build, train once, stage the checkpoint
    (phase 11 publishes it, as for the resident trainer)."""

    ensure_optimizer_state(plan, info, layout, plan["run_id"])
    train_iteration(load_held(plan, from_dict(TrainConfig, plan["config"]), info), plan, layout, iteration, attempt,
                    info)


def run(plan_path: Path, attempt: int) -> int:
    """The trainer's whole life on one rank; returns the process exit code."""
    from train.data import read_plan
    from train.distributed import init_distributed, launched_world_size, shutdown

    rank = int(os.environ.get("RANK", "0"))
    log.setup(f"train rank{rank}")
    try:
        layout, iteration = RunLayout.from_training_plan(plan_path)
        # The plan must be this run's: a training folder copied from another run would train
        # (and publish) on its data under this run's name.
        plan = read_plan(plan_path, run_id=read_record(layout.run_json, kind="run").run_id)
    except Exception as exc:  # noqa: BLE001 -- reported as the reason for the exit code
        _log.error("cannot read the training plan %s: %s", plan_path, exc)
        return 2
    world = launched_world_size()
    if world != plan["world_size"]:
        _log.error("the plan %s was made for %d trainer processes but %d were launched; launch nnodes x "
                   "nproc_per_node = %d processes, or prepare the data again for %d", plan_path,
                   plan["world_size"], world, plan["world_size"], world)
        return 2
    if is_complete(layout.checkpoint(iteration), run_id=plan["run_id"]):
        _log.info("iteration %d is already published at %s; nothing to train", iteration, layout.checkpoint(iteration))
        return 0
    info = None
    try:
        info = init_distributed(float(plan["config"]["collective_timeout"]))
        train(plan, layout, iteration, attempt, info)
        return 0
    except Exception as exc:  # noqa: BLE001 -- every failure becomes a non-zero exit and a result record
        _log.error("training iteration %d attempt %d failed on rank %d: %s", iteration, attempt, rank, exc,
                   exc_info=not _explained(exc))
        try:
            write_result(layout, iteration, attempt, rank, plan["run_id"],
                         {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        except OSError:
            pass
        return 1
    finally:
        if info is not None:
            shutdown()


def run_resident(log_path: Path, job: str, node_rank: int, launch: str) -> int:
    """A resident trainer process (train.resident): serve this node's orders until stopped.
    Returns the exit code: 0 after a stop order, 1 after a failed iteration (its result record
    says why), 2 on a plan that cannot be used, 4 when its driver is gone or its node was taken over."""
    from train.data import read_plan
    from train.distributed import shutdown
    from train.offload import device_memory_mb

    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    log.setup(f"train rank{rank}")
    layout = RunLayout(log_path)
    run_id = read_record(layout.run_json, kind="run").run_id
    box = Mailbox(layout.job(job), node_rank, launch, run_id=run_id, local_rank=local_rank)

    def gone(reason: str) -> None:
        _log.error("resident trainer %s exits: %s", launch, reason)
        exit_now(4)

    watch_driver(gone)
    box.say("idle")
    info, held, iteration, attempt = None, None, None, None
    try:
        while True:
            order = box.next_order()
            work = not order.get("stop") and not order.get("prepare")
            iteration, attempt = (int(order["iteration"]), int(order["attempt"])) if work else (None, None)
            # The last iteration's optimizer state is on disk before anything else happens: before
            # the next step changes it, a reload drops it, or the process ends. A failure here
            # fails this order's attempt (the retry's trainers replay that iteration).
            settle_optimizer_write(held, held.cfg.collective_timeout if held is not None else None)
            if order.get("stop"):
                _log.info("resident trainer %s: stop ordered after %d orders", launch, box.seq - 1)
                box.say("stopped")
                return 0
            prepare = order.get("prepare")
            if prepare:
                # Launched early (during the rollouts): load what the coming plan names, then wait.
                # A failure here writes no result: the driver notices the exit at phase 9 and
                # launches afresh, and that launch reports it.
                info = _process_group(info, prepare, "the early load")
                box.say("loading", iteration=int(prepare["iteration"]))
                # The inputs name this run's checkpoint; load_held checks it against the run's id.
                held = _load_resident({**prepare, "run_id": run_id}, info, layout, run_id, replaces=held)
                box.say("idle", device_memory_mb=device_memory_mb(info.device))
                continue
            plan_path = Path(order["plan"])
            plan = read_plan(plan_path, run_id=run_id)
            info = _process_group(info, plan, f"the plan {plan_path}")
            if held is None or held.config != plan["config"] or held.iteration != int(plan["input_iteration"]):
                # First order, or a plan that does not continue what this process holds: build from
                # the plan's input checkpoint and optimizer state (the durable state).
                box.say("loading", iteration=iteration)
                held = _load_resident(plan, info, layout, run_id, replaces=held)
                box.say("training", iteration=iteration, device_memory_mb=device_memory_mb(info.device))
            else:
                _log.info("resident trainer %s: iteration %d continues the model it holds (input iteration %d)",
                          launch, iteration, held.iteration)
                # Said before the copies come back: a state "offloaded" is never read while the
                # device holds them again. The record then gets the memory they take.
                box.say("training", iteration=iteration)
                held.offload.to_device()
                box.say("training", iteration=iteration, device_memory_mb=device_memory_mb(info.device),
                        to_timeline=False)

            def release(held: Held = held, iteration: int = iteration) -> dict[str, Any]:
                hold = os.environ.get("BATON_TEST_HOLD_OFFLOAD", "")  # tests: "N:S" holds iteration N's S seconds
                if hold and int(hold.split(":")[0]) == iteration:
                    time.sleep(float(hold.split(":")[1]))
                held.offload.to_host()
                held_mb = device_memory_mb(info.device)
                _log.info("offloaded %.1f MiB in %d storages to host memory; device memory still held %.1f MiB",
                          held.offload.moved_bytes / 2**20, held.offload.storages, held_mb)
                box.say("offloaded", iteration=iteration, device_memory_mb=held_mb)
                return {"released": True, "device_memory_mb_after_release": held_mb}

            train_iteration(held, plan, layout, iteration, attempt, info, defer_optimizer=True,
                            release=release if order.get("offload") else None)
            if not order.get("offload"):
                box.say("idle", iteration=iteration, device_memory_mb=device_memory_mb(info.device))
    except Exception as exc:  # noqa: BLE001 -- every failure becomes a result record and a non-zero exit
        _log.error("resident trainer %s failed%s: %s", launch,
                   f" in iteration {iteration} attempt {attempt}" if iteration is not None else "", exc,
                   exc_info=not _explained(exc))
        if iteration is not None:
            try:
                write_result(layout, iteration, attempt, rank, run_id, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            except OSError:
                pass
        box.say("failed", iteration=iteration, error=f"{type(exc).__name__}: {exc}"[:300])
        return 1
    finally:
        if info is not None:
            shutdown()


def ensure_optimizer_state(inputs: dict[str, Any], info, layout, run_id: str) -> None:
    """Collective: when the input checkpoint's optimizer state never reached the disk (a resident
    trainer died while writing it in the background), make it again first (the redo rule,
    docs/design.md §9.6): checkpoint N's plan is replayed from checkpoint N-1 and its state,
    seeded as before, and the optimizer state it ends with becomes iter-N/optimizer. The weights
    stay the published ones: the caller then loads them with that state."""
    from train.data import read_plan
    from train.distributed import agreed

    source, n = Path(inputs["input_checkpoint"]), int(inputs["input_iteration"])
    if n == 0:  # the base model: not a checkpoint of this run, nothing of it was written in the background
        return
    if not agreed("checking the input's optimizer state", info, lambda: optimizer_pending(source, run_id=run_id)):
        return
    started = time.monotonic()
    replay = read_plan(layout.training_plan(n), run_id=run_id)
    if replay["world_size"] != info.world_size:
        raise CheckpointError(f"the optimizer state of {source} is missing and its plan was made for "
                              f"{replay['world_size']} trainer processes, not {info.world_size}: restart with the "
                              f"nodes of the run, or remove {source} to train iteration {n} again")
    if info.is_main:
        _log.warning("the optimizer state of %s is not on disk (its trainer stopped while writing it): replaying "
                     "iteration %d from %s to make it again", source, n, replay["input_checkpoint"])
    ensure_optimizer_state(replay, info, layout, run_id)  # no-op: N-1's state was on disk before N trained
    again = load_held(replay, from_dict(TrainConfig, replay["config"]), info)
    train_steps(again, replay, layout, n, info)
    start_optimizer_write(again, layout, n, 0, info, run_id).wait(again.cfg.collective_timeout)
    again.tear_down(info.device)  # before the caller loads the model it trains: one model at a time
    if info.is_main:
        _log.info("replayed iteration %d (optimizer step %d) and wrote its optimizer state in %.1f s",
                  n, again.opt_step, time.monotonic() - started)


def _load_resident(inputs: dict[str, Any], info, layout, run_id: str, *, replaces: Held | None) -> Held:
    """Collective: load_held for a resident trainer (after ensure_optimizer_state), with the
    offload that can move it to host memory. The model it `replaces` is torn down first."""
    from train.memory import rss_mb
    from train.offload import ResidentOffload

    if replaces is not None:
        freed = replaces.tear_down(info.device)
        _log.info("rank %d tore down the model it held before loading another: %.1f MiB freed; RSS now %.1f MiB",
                  info.rank, freed / 2**20, rss_mb())
    ensure_optimizer_state(inputs, info, layout, run_id)
    held = load_held(inputs, from_dict(TrainConfig, inputs["config"]), info)
    held.offload = ResidentOffload([held.t.model, held.reference], held.t.optimizer, info.device)
    return held


def _process_group(info, inputs: dict[str, Any], what: str):
    """`info`, or the process group a plan (or an early load's inputs) needs: its collective timeout
    comes from its `train` config; the backends serve every plan (process_group_backend). Refuses
    inputs made for another world size."""
    from train.distributed import init_distributed, launched_world_size

    if launched_world_size() != inputs["world_size"]:
        raise ValueError(f"{what} was made for {inputs['world_size']} trainer processes but "
                         f"{launched_world_size()} were launched")
    if info is not None:
        return info
    return init_distributed(float(inputs["config"]["collective_timeout"]))


def _explained(exc: Exception) -> bool:
    """Failures whose message says everything (no traceback in the log)."""
    from train.batches import ShardError
    from train.distributed import PeerFailed
    from train.step import TrainingDiverged

    return isinstance(exc, (ShardError, CheckpointError, PeerFailed, TrainingDiverged, FileNotFoundError, ConfigError))


def bench_command(opts: dict, config_files: tuple[Path, ...], overrides: tuple[str, ...]) -> int:
    """`--bench`: the RL (GRPO) step on fake data; exit 2 on a configuration to fix."""
    from train.distributed import init_distributed, shutdown

    log.setup(f"bench rank{os.environ.get('RANK', '0')}")
    info = None
    try:
        cfg = train_config_from({}, config_files, overrides)
        with bench_model(opts["model"], opts["bench_seq_len"]) as model_path:
            info = init_distributed(cfg.collective_timeout)
            report = run_benchmark(cfg, {**opts, "model_path": model_path}, info, entry="trainer",
                           algorithm="grpo" if cfg.algorithm == "grpo" else "rft")
    except ConfigError as exc:
        _log.error("%s", exc)
        return 2
    finally:
        if info is not None:
            shutdown()
    if info.is_main:
        print_and_write(report, opts["bench_output_json"])
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), default=None,
              help="training/iter-N/plan.json written by phase 8 (train.data.prepare_training_data)")
@click.option("--attempt", type=int, default=1, show_default=True,
              help="attempt number; each attempt stages its checkpoint in its own folder")
@click.option("--model", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="--bench: Hugging Face folder to benchmark (default: a tiny model written on the fly)")
@click.option("--config", "config_files", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              multiple=True, help="--bench: YAML file(s) whose `train` section sets the levers")
@click.option("--resident", "resident", default=None, metavar="LAUNCH",
              help="serve orders of the driver as the resident trainer launched as LAUNCH (needs --log-path, "
                   "--job, --for-node; docs/design.md §2)")
@click.option("--log-path", "log_path", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="--resident: the run folder")
@click.option("--job", default=None, help="--resident: the job whose node gives the orders")
@click.option("--for-node", "node_rank", type=int, default=None, help="--resident: the node rank giving the orders")
@bench_options
@click.argument("overrides", nargs=-1)
def main(plan_path: Path | None, attempt: int, model: Path | None, config_files: tuple[Path, ...],
         overrides: tuple[str, ...], resident: str | None, log_path: Path | None, job: str | None,
         node_rank: int | None, **bench) -> None:
    """Train one iteration from its plan and publish checkpoints/iter-N (run under torchrun).

    With --bench: benchmark training steps on fake data; OVERRIDES are train config keys
    (key=value, e.g. ac.freq=1 fused_lm_head_token_chunk_size=disabled lora.rank=8)."""

    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    if bench["bench"]:
        if plan_path is not None:
            raise click.UsageError("--bench trains on fake data and takes no --plan")
        exit_now(bench_command({**bench, "model": model}, config_files, overrides))
    if resident is not None:
        if plan_path is not None or log_path is None or job is None or node_rank is None:
            raise click.UsageError("--resident LAUNCH takes --log-path, --job and --for-node (and no --plan: orders name "
                                   "the plans)")
        exit_now(run_resident(log_path, job, node_rank, resident))
    if plan_path is None:
        raise click.UsageError("give --plan PLAN (the training plan of phase 8), or --bench to benchmark")
    if overrides or config_files or model is not None:
        raise click.UsageError("--model, --config and key=value overrides are for --bench; a training run takes its "
                               "config from the plan")
    exit_now(run(plan_path, attempt))


if __name__ == "__main__":
    main()
