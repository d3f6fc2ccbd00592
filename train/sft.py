"""Supervised fine-tuning: `python -m train.sft` (one process) or `torchrun ... -m train.sft` (several).

Trains on JSONL examples (train/sft_data.py) with the loss on completion tokens only, normalised
over the completion tokens of the global batch, with the same model, parallelism and optimizer
code as the RL trainer, and writes the same checkpoint format (HF folder, trainer_state.json,
completeness marker; optimizer state with --save-optimizer). The output folder appears only
when complete (written beside it, then renamed).

With --eval-data and --target-accuracy it stops as soon as greedy exact-match accuracy (scored
by a rollout reward function) reaches the target: the demo warm-starts the tiny model this way.
With --eval-env the accuracy is the success rate of greedy episodes of that environment: the
agent demo warm-starts on worked episodes (multi-turn chat examples, train/sft_data.py) so.
If the target is not reached within --steps, the checkpoint is still written, a warning says so
and trainer_state.json records `target_reached: false`.

Trailing `key=value` arguments set any `train` config key, e.g. the memory levers
(`ac.freq=1 lora.rank=8`); `--bench` benchmarks SFT steps on fake data (train/benchmark.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import click

from coordination import log
from coordination.config import ConfigError
from coordination.progress import Progress
from coordination.records import restrict_umask
from rollout.envs import EnvError, load_env
from rollout.rewards import load_reward
from rollout.tasks import load_tasks
from train.benchmark import bench_model, bench_options, print_and_write, run_bench, train_config_from
from train.launch import exit_now
from train.optim import lr_at
from train.packing import pack_step
from train.sft_data import load_examples

_log = logging.getLogger("baton.train.sft")


def _batches(n: int, batch_size: int, seed: int):
    """Endless seeded stream of index batches, epoch after epoch (same on every rank)."""
    import numpy as np

    rng = np.random.default_rng([int(seed), 0x5F7])
    pool: list[int] = []
    while True:
        while len(pool) < batch_size:
            pool.extend(int(i) for i in rng.permutation(n))
        yield pool[:batch_size]
        pool = pool[batch_size:]


def eval_due(step: int, accuracy: float | None, opts: dict) -> bool:
    """Whether to evaluate after `step`: every --eval-every steps and at the last step; while the
    latest eval (`accuracy`) is at least a quarter of --target-accuracy, every --eval-every-near
    steps, because accuracy can jump from a few percent past the target within 25 steps and a
    finer stop lands nearer it."""
    if step == opts["steps"]:
        return True
    target = opts["target_accuracy"]
    near = target is not None and accuracy is not None and accuracy >= target / 4
    return step % (min(opts["eval_every"], opts["eval_every_near"]) if near else opts["eval_every"]) == 0


def _micro_batches(examples, batch: list[int], info, budget: int, pad_id: int, cp: int):
    """This rank's micro-batches of a global batch (every rank packs the same batch identically)."""
    from train.batches import collate

    # The cp ranks of a context-parallel group share one data rank's micro-batches.
    pack = pack_step(batch, [len(examples[i]) for i in batch], budget=budget, world_size=info.world_size // cp)
    ours = pack.ranks[info.rank // cp]
    mine = ours + [[]] * (pack.micro_batches_per_rank - len(ours))
    return [collate([{"prompt_ids": examples[i].prompt_ids, "completion_ids": examples[i].completion_ids,
                      "loss_mask": examples[i].loss_mask} for i in members], pad_id) for members in mine]


def _train(opts: dict, cfg, info) -> dict:
    """Load, train until --steps or the accuracy target, write the output. Collective."""
    import torch
    from transformers import AutoTokenizer

    from train.build import load_model, make_trainable, preflight
    from train.distributed import agreed
    from train.evaluate import EpisodeEval, greedy_accuracy
    from train.step import StepSettings, train_step

    agreed("checking the trainer settings", info, lambda: preflight(cfg, info))
    torch.manual_seed(cfg.seed)

    def load():
        tok = AutoTokenizer.from_pretrained(str(opts["model"]))
        tasks = load_tasks(opts["eval_data"])[:opts["eval_limit"]] if opts["eval_data"] else []
        return tok, load_examples(opts["data"], tok), tasks, load_model(cfg, opts["model"], None)

    tok, examples, eval_tasks, loaded = agreed("loading the model and the SFT data", info, load)
    reward = load_reward(opts["reward"]) if eval_tasks and not opts["eval_env"] else None
    episodes = EpisodeEval(opts["model"], tok, eval_tasks, load_env(opts["eval_env"]),
                           max_turns=opts["eval_max_turns"], max_new_tokens=opts["max_new_tokens"]) \
        if eval_tasks and opts["eval_env"] else None
    t = make_trainable(loaded, cfg, info)
    policy, model, optimizer, params = t.policy, t.model, t.optimizer, t.params
    settings = StepSettings(algorithm="sft", backend=cfg.backend, dtype=t.dtype, grad_clip=cfg.grad_clip)
    lm = loaded.lm
    pad_id = lm.config.pad_token_id if lm.config.pad_token_id is not None else 0
    generate = policy.generate if cfg.backend == "fsdp" else model.module.generate
    target = opts["target_accuracy"]
    _log.info("SFT of %s on %d examples (%s), %d ranks, batch %d, lr %.1e, up to %d steps%s", opts["model"],
              len(examples), opts["data"], info.world_size, opts["batch_size"], cfg.lr, opts["steps"],
              f", stop at accuracy {target:.0%} on {len(eval_tasks)} eval tasks" if target is not None else "")
    losses, evals, accuracy, step = [], [], None, 0
    stream = _batches(len(examples), opts["batch_size"], cfg.seed)
    started = time.monotonic()
    with Progress("sft", total=opts["steps"], unit="steps", interactive=False if info.rank else None) as bar:
        for step in range(1, opts["steps"] + 1):
            batch = next(stream)
            lr = lr_at(step - 1, lr=cfg.lr, schedule="constant", warmup_steps=cfg.warmup_steps, decay_steps=0,
                       min_ratio=1.0)
            metrics = train_step(model, params, optimizer,
                                 _micro_batches(examples, batch, info, cfg.micro_batch_tokens, pad_id, cfg.cp), lr=lr,
                                 global_completion_tokens=sum(examples[i].trained_tokens for i in batch),
                                 settings=settings, info=info, router_loss=t.router_loss)
            losses.append([step, round(metrics.loss, 5)])
            bar.advance(1, tokens=metrics.tokens)
            if info.is_main and (step % opts["log_every"] == 0 or step == 1):
                _log.info(metrics.line(f"sft step {step}"))
            if not eval_tasks or not eval_due(step, accuracy, opts):
                continue
            model.eval()
            if episodes is not None:
                accuracy = episodes(policy, info)
            else:
                accuracy = greedy_accuracy(generate, tok, eval_tasks, reward, info=info,
                                           batch_size=opts["eval_batch_size"], max_new_tokens=opts["max_new_tokens"],
                                           synced=cfg.backend == "fsdp" and info.world_size > 1)
            model.train()
            evals.append([step, accuracy])
            if info.is_main:
                _log.info("sft step %d: greedy accuracy %.1f%% on %d eval tasks", step, 100 * accuracy,
                          len(eval_tasks))
            if target is not None and accuracy >= target:
                break
    reached = None if target is None else (accuracy is not None and accuracy >= target)
    if reached is False and info.is_main:
        _log.warning("accuracy %.1f%% did not reach the target %.1f%% within %d steps; the checkpoint is written "
                     "anyway -- raise --steps or lower --target-accuracy", 100 * (accuracy or 0), 100 * target,
                     opts["steps"])
    summary = {"steps": step, "loss": losses, "eval_accuracy": evals, "target_accuracy": target,
               "target_reached": reached, "data": str(opts["data"]), "seconds": time.monotonic() - started}
    _write_output(opts, t, info, cfg, summary)
    return summary


def _write_output(opts: dict, t, info, cfg, summary: dict) -> None:
    """The same checkpoint format as RL, written beside --out and renamed into place when complete."""
    from train.distributed import agreed
    from train.export import prepare_output_dir, save_checkpoint

    out: Path = opts["out"]
    staging = out.parent / f".{out.name}.partial"
    if not opts["save_optimizer"]:
        t.optimizer.state.clear()
    agreed("preparing the output folder", info, lambda: prepare_output_dir(staging, info))
    save_checkpoint(staging, policy=t.policy, optimizer=t.optimizer, info=info, backend=cfg.backend, run_id="sft",
                    iteration=0, tokenizer_source=opts["model"],
                    trainer_state={"optimizer_step": summary["steps"] if opts["save_optimizer"] else 0,
                                   "iteration": 0, "algorithm": "sft", "sft": summary},
                    lora=cfg.lora, lora_record=t.weights.record)
    agreed("moving the output into place", info, lambda: os.rename(staging, out) if info.is_main else None)


def sft_config(opts: dict):
    """The train config of SFT: its command-line flags <- --config files <- key=value overrides."""
    flags = {"algorithm": "rft", "backend": opts["backend"], "lr": opts["lr"], "weight_decay": opts["weight_decay"],
             "grad_clip": opts["grad_clip"], "micro_batch_tokens": opts["micro_batch_tokens"],
             "warmup_steps": opts["warmup_steps"], "dtype": opts["dtype"], "seed": opts["seed"]}
    return train_config_from(flags, opts["config_files"], opts["overrides"])


def _bench(opts: dict, cfg) -> int:
    from train.distributed import init_distributed, shutdown

    try:
        with bench_model(opts["model"], opts["bench_seq_len"]) as model_path:
            info = init_distributed(cfg.collective_timeout)
            try:
                report = run_bench(cfg, {**opts, "model_path": model_path}, info, entry="sft", algorithm="sft")
            finally:
                shutdown()
    except ConfigError as exc:
        _log.error("%s", exc)
        return 2
    if info.is_main:
        print_and_write(report, opts["bench_output_json"])
    return 0


def run_sft(opts: dict) -> int:
    from train.distributed import init_distributed, shutdown

    log.setup(f"sft rank{os.environ.get('RANK', '0')}")
    try:
        cfg = sft_config(opts)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if opts["bench"]:
        return _bench(opts, cfg)
    info = init_distributed(cfg.collective_timeout)
    try:
        summary = _train(opts, cfg, info)
    except ConfigError as exc:
        _log.error("%s", exc)
        return 2
    finally:
        shutdown()
    if info.is_main:
        losses = summary["loss"]
        accuracy = summary["eval_accuracy"][-1][1] if summary["eval_accuracy"] else None
        _log.info("wrote %s after %d steps (loss %.4f -> %.4f%s)", opts["out"], summary["steps"], losses[0][1],
                  losses[-1][1], f", accuracy {accuracy:.1%}" if accuracy is not None else "")
    return 0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Hugging Face folder to fine-tune (required unless --bench, which defaults to a tiny model)")
@click.option("--data", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="JSONL: baton tasks (prompt/answer), prompt/completion, or chat messages (required unless --bench)")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="checkpoint folder to write, new (required unless --bench)")
@click.option("--eval-data", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="baton task JSONL for greedy exact-match accuracy")
@click.option("--target-accuracy", type=click.FloatRange(0, 1), default=None,
              help="stop once eval accuracy reaches this (needs --eval-data)")
@click.option("--eval-every", type=click.IntRange(1), default=25, show_default=True, help="steps between evals")
@click.option("--eval-every-near", type=click.IntRange(1), default=5, show_default=True,
              help="steps between evals while the latest eval is at least a quarter of --target-accuracy")
@click.option("--eval-limit", type=click.IntRange(1), default=500, show_default=True, help="eval tasks used at most")
@click.option("--eval-batch-size", type=click.IntRange(1), default=128, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(1), default=16, show_default=True, help="greedy eval length")
@click.option("--reward", default="arithmetic", show_default=True, help="rollout reward spec that scores evals")
@click.option("--eval-env", default=None,
              help="evaluate greedy episodes of this environment (as tasks.env: calculator, guess or module:factory) "
                   "instead of single completions; accuracy is their success rate (reward >= 1)")
@click.option("--eval-max-turns", type=click.IntRange(1), default=4, show_default=True,
              help="--eval-env: most policy turns of an eval episode")
@click.option("--steps", type=click.IntRange(1), default=1000, show_default=True, help="maximum optimizer steps")
@click.option("--batch-size", type=click.IntRange(1), default=256, show_default=True, help="global examples per step")
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--weight-decay", type=float, default=0.0, show_default=True)
@click.option("--warmup-steps", type=click.IntRange(0), default=0, show_default=True)
@click.option("--grad-clip", type=float, default=1.0, show_default=True)
@click.option("--micro-batch-tokens", type=click.IntRange(16), default=16384, show_default=True)
@click.option("--backend", type=click.Choice(["fsdp", "ddp"]), default="fsdp", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--log-every", type=click.IntRange(1), default=10, show_default=True)
@click.option("--save-optimizer/--no-save-optimizer", default=False, show_default=True,
              help="keep Adam state in the checkpoint (an RL run started from it then continues that state)")
@click.option("--config", "config_files", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              multiple=True, help="YAML file(s) whose `train` section sets further train keys (levers)")
@bench_options
@click.argument("overrides", nargs=-1)
def main(**opts) -> None:
    """Fine-tune a model on JSONL examples and write a checkpoint folder.

    OVERRIDES are train config keys (key=value), e.g. ac.freq=1 lora.rank=8; --bench benchmarks
    SFT steps on fake data instead (no --data or --out)."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    if opts["bench"]:
        exit_now(run_sft(opts))
    missing = [f"--{k}" for k in ("model", "data", "out") if opts[k] is None]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or pass --bench to benchmark on fake data)")
    out: Path = opts["out"]
    if opts["target_accuracy"] is not None and opts["eval_data"] is None:
        raise click.UsageError("--target-accuracy needs --eval-data (the tasks to measure accuracy on)")
    if opts["eval_env"] is not None:
        if opts["eval_data"] is None:
            raise click.UsageError("--eval-env needs --eval-data (the tasks whose episodes are evaluated)")
        try:
            load_env(opts["eval_env"])
        except EnvError as exc:
            raise click.UsageError(f"--eval-env: {exc}") from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise click.UsageError(f"--out {out} already exists and is not empty; choose a new folder or remove it")
    if out.exists():
        with contextlib.suppress(FileNotFoundError):  # several ranks may race to remove it
            out.rmdir()
    exit_now(run_sft(opts))


if __name__ == "__main__":
    main()
