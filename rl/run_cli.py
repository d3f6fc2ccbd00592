"""`scripts/run.sh`: the reference pipeline's interface, parsed and checked here.

    scripts/run.sh --data-path P --log-path L --rl-phase rollout|update|both [--eval-interval K]
                   [--rollout-split train-only|eval-only] [--num-nodes N --rank-weights w0,...]
                   [--master | --worker R] [--debug-mode] [--resume] [--dry-run] [--config FILE]
                   [key=value ...]
    scripts/run.sh --data-path P --log-path L --bench [--bench-steps 5 ...] [--num-nodes N ...] [key=value ...]

`--bench` (instead of --rl-phase) runs the trainer's benchmark (train/benchmark.py: fake data, a
step table, JSON) as one multi-node torchrun of this run's `train` config, so the levers of a run
are measured on the nodes and interconnect it will use, with the same flags and rendezvous.

Every rule of the run's inputs is in rl/validate and applied here, once, before anything is
written: a misused flag exits 2 with a line per failing rule and the usage, a config or input the
run cannot use exits 2 with every failing rule (a dry run prints them beside its plan). Nothing
heavy is imported before the flags are known to be good, so `--help` and mistakes answer at once.
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
from rl.jobs import RL_PHASES, kind_for
from rl.validate import failures
from rl.validate.flags import FLAG_RULES, Flags, node_rank
from rollout.split import parse_rank_weights

from train.benchmark import bench_options  # click and the standard library only: --help stays instant

USAGE_EPILOG = ("\b\nExamples: two nodes, the master on node A:\n\n"
                "  scripts/run.sh --data-path /shared/tasks --log-path /shared/runs/r1 --rl-phase both "
                "--eval-interval 2 --num-nodes 2 --rank-weights 2,1 --master model.path=/shared/models/m\n\n"
                "and the same command with --worker 1 instead of --master on node B.")


def _bench(bench: dict) -> tuple[dict | None, tuple[str, ...]]:
    """(the --bench-* options when --bench is given, else None; the --bench-* options given on the command line)."""
    wanted = bench.pop("bench")
    ctx = click.get_current_context(silent=True)
    given = tuple(k for k in bench if ctx is not None and ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE)
    if not wanted:
        return None, given
    if bench["bench_output_json"] is not None:  # the trainer's rank 0 may run in another node's folder
        bench["bench_output_json"] = bench["bench_output_json"].absolute()
    return bench, given


def _warn_literal_secrets(overrides) -> None:
    for o in overrides:
        if redact_argv([o]) != [o]:
            key = o.partition("=")[0].strip()
            click.echo(f"warning: {key}=... on the command line holds a secret that is visible to every user through "
                       f"ps; give it as env:NAME or file:PATH (baton shows it as *** everywhere it writes)", err=True)


def parse(data_path, log_path, rl_phase, eval_interval, rollout_split, num_nodes, rank_weights, master, worker,
          debug_mode, resume, dry_run, configs, overrides, **bench) -> RunArgs:
    """The flags held to the command line's rules (rl/validate/flags.py), every failure at once."""
    bench, bench_given = _bench(bench)
    flags = Flags(rl_phase, eval_interval, rollout_split, num_nodes, rank_weights, master, worker, debug_mode,
                  tuple(overrides), bench is not None, bench_given)
    problems = failures(FLAG_RULES, flags)
    if problems:
        raise click.UsageError("\n".join(map(str, problems)))
    _warn_literal_secrets(overrides)
    weights = parse_rank_weights(rank_weights) if rank_weights is not None else [1.0]
    kind = kind_for(rl_phase, rollout_split, bench=bench is not None)
    return RunArgs(Path(data_path), Path(log_path), kind, eval_interval, num_nodes, weights, node_rank(flags),
                   debug_mode, resume, dry_run, [Path(c) for c in configs], list(overrides),
                   command=shlex.join(["scripts/run.sh"] + redact_argv(sys.argv[1:])), bench=bench)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
               epilog=USAGE_EPILOG)
@click.option("--data-path", required=True, type=click.Path(path_type=Path),
              help="folder of task files (train.jsonl, eval.jsonl), the same on every node")
@click.option("--log-path", required=True, type=click.Path(path_type=Path),
              help="run folder on the shared filesystem (NFS, Lustre, GPFS), the same on every node")
@click.option("--rl-phase", type=click.Choice(RL_PHASES), default=None,
              help="which phases this job runs: rollout 0-6, update 7-13, both 0-13 per iteration (required "
                   "unless --bench)")
@click.option("--eval-interval", type=int, default=None,
              help="evaluate at iterations 1, 1+K, 1+2K, ... (required with --rl-phase both; 0 = never)")
@click.option("--rollout-split", type=click.Choice(["train-only", "eval-only"]), default=None,
              help="with --rl-phase rollout: roll out train tasks or evaluate")
@click.option("--num-nodes", type=int, default=1, show_default=True, help="nodes in this job")
@click.option("--rank-weights", default=None, metavar="W0,W1,...",
              help="share of the rollout work per node (required when --num-nodes > 1; 0 = no rollout "
                   "tasks), e.g. 2,1")
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
    from rl.validate.run import run_failures

    try:
        cfg = load_run_config(args.configs, args.overrides, args.config_flags())
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    # Every rule of the composed config, before anything is written (rl/validate/run.py).
    problems = run_failures(args, cfg)
    if args.dry_run:
        from rl.dryrun import dry_run

        sys.exit(dry_run(args, cfg, problems))
    if problems:
        for p in problems:
            click.echo(f"Error: {p}", err=True)
        sys.exit(2)
    from rl.driver import run_node

    sys.exit(run_node(args, cfg))


if __name__ == "__main__":
    main(prog_name=os.environ.get("BATON_PROG", "scripts/run.sh"))
