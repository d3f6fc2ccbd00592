"""`scripts/run.sh`: the reference pipeline's interface, parsed and checked here.

    scripts/run.sh --data-path P --log-path L --rl-phase rollout|update|both [--eval-interval K]
                   [--rollout-split train-only|eval-only] [--num-nodes N --rank-weights w0,...]
                   [--master | --worker R] [--debug-mode] [--resume] [--dry-run] [--config FILE]
                   [key=value ...]
    scripts/run.sh --data-path P --log-path L --bench [--bench-steps 5 ...] [--num-nodes N ...] [key=value ...]

`--bench` (instead of --rl-phase) runs the trainer's benchmark (train/benchmark.py: fake data, a
step table, JSON) as one multi-node torchrun of this run's `train` config, so the levers of a run
are measured on the nodes and interconnect it will use, with the same flags and rendezvous.

Every misuse exits 2 with a one-line reason and the usage. Nothing heavy is imported before the
arguments are known to be good, so `--help` and mistakes answer at once.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from coordination.config import ConfigError, redact_argv
from coordination.records import restrict_umask
from rl.args import RunArgs

from train.benchmark import bench_options  # click and the standard library only: --help stays instant

USAGE_EPILOG = ("\b\nExamples: two nodes, the master on node A:\n\n"
                "  scripts/run.sh --data-path /shared/tasks --log-path /shared/runs/r1 --rl-phase both "
                "--eval-interval 2 --num-nodes 2 --rank-weights 2,1 --master model.path=/shared/models/m\n\n"
                "and the same command with --worker 1 instead of --master on node B.")


def _fail(msg: str) -> None:
    raise click.UsageError(msg)


def _parse_weights(text: str | None, n: int) -> list[float]:
    if text is None:
        if n > 1:
            _fail(f"--rank-weights is required with --num-nodes {n}: one positive number per node, e.g. "
                  f"--rank-weights {','.join(['1'] * n)}")
        return [1.0]
    parts = [p.strip() for p in text.split(",")]
    weights = []
    for p in parts:
        try:
            w = float(p)
        except ValueError:
            _fail(f"--rank-weights {text!r}: {p!r} is not a number; give one positive number per node, e.g. 2,1")
        if not w > 0 or w != w or w == float("inf"):
            _fail(f"--rank-weights {text!r}: every weight must be a positive number (got {p})")
        weights.append(w)
    if len(weights) != n:
        _fail(f"--rank-weights has {len(weights)} weight(s) but --num-nodes is {n}; give exactly one per node")
    return weights


def _rank(master: bool, worker: int | None, n: int) -> int:
    env_rank = None
    for var in ("RANK", "NODE_RANK"):
        if os.environ.get(var, "").strip():
            try:
                env_rank = int(os.environ[var])
            except ValueError:
                _fail(f"{var}={os.environ[var]!r} in the environment is not a node rank; unset it or give --worker R")
            break
    if master and worker is not None:
        _fail("--master and --worker are exclusive: rank 0 is the master, give one of them")
    if worker is not None and worker == 0:
        _fail("--worker 0 is the master: use --master on that node")
    flag_rank = 0 if master else worker
    if flag_rank is not None and env_rank is not None and flag_rank != env_rank:
        _fail(f"the command line says rank {flag_rank} but RANK/NODE_RANK says {env_rank}; drop one of them")
    rank = flag_rank if flag_rank is not None else env_rank
    if rank is None:
        if n == 1:
            return 0
        _fail(f"say which node this is: --master on one node and --worker R (1..{n - 1}) on the others")
    if not 0 <= rank < n:
        _fail(f"--worker rank must be between 1 and {n - 1} for {n} nodes (got {rank})")
    return rank


def _bench_mode(rl_phase, eval_interval, rollout_split, debug_mode, bench: dict) -> dict | None:
    """The --bench-* options when --bench is given (checked against the RL flags), else None."""
    if not bench.pop("bench"):
        ctx = click.get_current_context(silent=True)
        given = [k for k in bench if ctx is not None and ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE]
        if given:
            _fail(f"--{given[0].replace('_', '-')} only applies with --bench")
        if rl_phase is None:
            _fail("--rl-phase rollout|update|both is required (or --bench to benchmark the trainer)")
        return None
    for flag, value in (("--rl-phase", rl_phase), ("--eval-interval", eval_interval),
                        ("--rollout-split", rollout_split), ("--debug-mode", debug_mode or None)):
        if value is not None:
            _fail(f"--bench benchmarks the trainer on fake data and takes no {flag}; drop it")
    if bench["bench_output_json"] is not None:  # the trainer's rank 0 may run in another node's folder
        bench["bench_output_json"] = bench["bench_output_json"].absolute()
    return bench


def _warn_literal_secrets(overrides) -> None:
    for o in overrides:
        if redact_argv([o]) != [o]:
            key = o.partition("=")[0].strip()
            click.echo(f"warning: {key}=... on the command line holds a secret that is visible to every user through "
                       f"ps; give it as env:NAME or file:PATH (baton shows it as *** everywhere it writes)", err=True)


def parse(data_path, log_path, rl_phase, eval_interval, rollout_split, num_nodes, rank_weights, master, worker,
          debug_mode, resume, dry_run, configs, overrides, **bench) -> RunArgs:
    bench = _bench_mode(rl_phase, eval_interval, rollout_split, debug_mode, bench)
    if bench is not None:
        rl_phase = "bench"
    if rl_phase == "both" and eval_interval is None:
        _fail("--eval-interval K is required with --rl-phase both (evaluate at iterations 1, 1+K, ...; "
              "0 turns evaluation off)")
    if eval_interval is not None and eval_interval < 0:
        _fail(f"--eval-interval must be 0 or a positive number of iterations (got {eval_interval})")
    if rl_phase == "rollout" and rollout_split is None:
        _fail("--rollout-split train-only|eval-only is required with --rl-phase rollout")
    if rl_phase != "rollout" and rollout_split is not None:
        _fail(f"--rollout-split only applies to --rl-phase rollout (got --rl-phase {rl_phase})")
    if num_nodes < 1:
        _fail(f"--num-nodes must be at least 1 (got {num_nodes})")
    weights = _parse_weights(rank_weights, num_nodes)
    rank = _rank(master, worker, num_nodes)
    for o in overrides:
        if "=" not in o or o.startswith("="):
            _fail(f"unexpected argument {o!r}: config overrides are key=value, e.g. train.lr=1e-4")
    _warn_literal_secrets(overrides)
    return RunArgs(Path(data_path), Path(log_path), rl_phase, eval_interval, rollout_split, num_nodes, weights, rank,
                   debug_mode, resume, dry_run, [Path(c) for c in configs], list(overrides),
                   command=shlex.join(["scripts/run.sh"] + redact_argv(sys.argv[1:])), bench=bench)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
               epilog=USAGE_EPILOG)
@click.option("--data-path", required=True, type=click.Path(path_type=Path),
              help="folder of task files (train.jsonl, eval.jsonl), the same on every node")
@click.option("--log-path", required=True, type=click.Path(path_type=Path),
              help="run folder on the shared filesystem (NFS, Lustre, GPFS), the same on every node")
@click.option("--rl-phase", type=click.Choice(["rollout", "update", "both"]), default=None,
              help="which phases this job runs: rollout 0-6, update 7-13, both 0-13 per iteration (required "
                   "unless --bench)")
@click.option("--eval-interval", type=int, default=None,
              help="evaluate at iterations 1, 1+K, 1+2K, ... (required with --rl-phase both; 0 = never)")
@click.option("--rollout-split", type=click.Choice(["train-only", "eval-only"]), default=None,
              help="with --rl-phase rollout: roll out train tasks or evaluate")
@click.option("--num-nodes", type=int, default=1, show_default=True, help="nodes in this job")
@click.option("--rank-weights", default=None, metavar="W0,W1,...",
              help="share of the rollout work per node (required when --num-nodes > 1), e.g. 2,1")
@click.option("--master", is_flag=True, help="this node is rank 0 (or set RANK/NODE_RANK=0)")
@click.option("--worker", type=int, default=None, metavar="R", help="this node is worker R (1..N-1)")
@click.option("--debug-mode", is_flag=True, help="use an inference server you run yourself (inference.vllm.debug_url)")
@click.option("--resume", is_flag=True, help="continue the run in --log-path even though the config changed")
@click.option("--dry-run", is_flag=True, help="print the config, this rank's plan and commands; touch nothing")
@click.option("--config", "configs", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML config layered over configs/default.yaml (repeatable)")
@bench_options
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def main(**kw) -> None:
    """Run this node's part of a baton RL job. Start it with the same --log-path on every node."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    args = parse(**kw)
    # The run config, the trainer's checks and the driver are imported only now, after the flags
    # parsed: `--help` and usage errors answer at once (tests/test_run_cli.py checks it).
    from rl.runconfig import load_run_config

    try:
        cfg = load_run_config(args.configs, args.config_overrides())
        cfg.check_for(args.rl_phase)
        if args.kind.trains:
            from train.config import check_launch

            check_launch(cfg.train, args.num_nodes, cfg.model.path)
        if args.bench is None:
            from train.memory_check import check_memory

            # Before run_node writes anything: a trainer and an engine that cannot share the GPUs
            # would otherwise fail with an out-of-memory error at the first training step or wake.
            check_memory(cfg, serves=args.kind.serves, trains=args.kind.trains, num_nodes=args.num_nodes,
                         debug_mode=args.debug_mode)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    from rl.driver import run_node

    sys.exit(run_node(args, cfg))


if __name__ == "__main__":
    main(prog_name=os.environ.get("BATON_PROG", "scripts/run.sh"))
