"""The rules of the command line as typed, before a config can be composed from it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from coordination.config import ConfigError
from rl.jobs import kind_for
from rl.validate import Rule
from rollout.split import parse_rank_weights


@dataclass(frozen=True)
class Flags:
    """The flags of `scripts/run.sh` as typed (click has already read numbers and choices)."""

    rl_phase: str | None
    eval_interval: int | None
    rollout_split: str | None
    num_nodes: int
    rank_weights: str | None
    master: bool
    worker: int | None
    debug_mode: bool = False
    overrides: tuple[str, ...] = ()
    bench: bool = False
    bench_given: tuple[str, ...] = ()  # --bench-* options given on the command line
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def bench_options_need_bench(f: Flags) -> str | None:
    if not f.bench and f.bench_given:
        return f"--{f.bench_given[0].replace('_', '-')} only applies with --bench"
    return None


def bench_takes_no_rl_flags(f: Flags) -> str | None:
    if not f.bench:
        return None
    for flag, value in (("--rl-phase", f.rl_phase), ("--eval-interval", f.eval_interval),
                        ("--rollout-split", f.rollout_split), ("--debug-mode", f.debug_mode or None)):
        if value is not None:
            return f"--bench benchmarks the trainer on fake data and takes no {flag}; drop it"
    return None


def job_selected(f: Flags) -> str | None:
    """--rl-phase, --rollout-split and --bench select one job kind (rl/jobs.py kind_for)."""
    try:
        kind_for(f.rl_phase, f.rollout_split, bench=f.bench)
    except ValueError as exc:
        return str(exc)
    return None


def eval_interval_given(f: Flags) -> str | None:
    kind = kind_for(f.rl_phase, f.rollout_split, bench=f.bench)
    if kind.evaluates_on_interval and f.eval_interval is None:
        return (f"--eval-interval K is required with {kind.flags} (evaluate at iterations 1, 1+K, ...; "
                "0 turns evaluation off)")
    return None


def num_nodes_positive(f: Flags) -> str | None:
    if f.num_nodes < 1:
        return f"--num-nodes must be at least 1 (got {f.num_nodes})"
    return None


def rank_weights(f: Flags) -> str | None:
    """One weight per node, each as rollout/split.py's rule wants it."""
    if f.rank_weights is None:
        if f.num_nodes > 1:
            return (f"--rank-weights is required with --num-nodes {f.num_nodes}: one weight per node, e.g. "
                    f"--rank-weights {','.join(['1'] * f.num_nodes)}")
        return None
    try:
        weights = parse_rank_weights(f.rank_weights)
    except ValueError as exc:
        return str(exc)
    if len(weights) != f.num_nodes:
        return (f"--rank-weights has {len(weights)} weight(s) but --num-nodes is {f.num_nodes}; give exactly one "
                f"per node")
    return None


def _node_rank(f: Flags) -> tuple[int | None, str | None]:
    """(this node's rank, None) or (None, why it cannot be told) from --master/--worker/RANK/NODE_RANK."""
    env_rank = None
    for var in ("RANK", "NODE_RANK"):
        if f.environ.get(var, "").strip():
            try:
                env_rank = int(f.environ[var])
            except ValueError:
                return None, (f"{var}={f.environ[var]!r} in the environment is not a node rank; unset it or give "
                              f"--worker R")
            break
    if f.master and f.worker is not None:
        return None, "--master and --worker are exclusive: rank 0 is the master, give one of them"
    if f.worker == 0:
        return None, "--worker 0 is the master: use --master on that node"
    flag_rank = 0 if f.master else f.worker
    if flag_rank is not None and env_rank is not None and flag_rank != env_rank:
        return None, f"the command line says rank {flag_rank} but RANK/NODE_RANK says {env_rank}; drop one of them"
    rank = flag_rank if flag_rank is not None else env_rank
    n = f.num_nodes
    if rank is None:
        if n == 1:
            return 0, None
        return None, f"say which node this is: --master on one node and --worker R (1..{n - 1}) on the others"
    if not 0 <= rank < n and n == 1:
        return None, (f"--num-nodes 1 has only the master, but this node says rank {rank}; use --master, or "
                      f"give --num-nodes (and --rank-weights) for every node of the job")
    if not 0 <= rank < n:
        return None, f"--worker rank must be between 1 and {n - 1} for {n} nodes (got {rank})"
    return rank, None


def node_rank(f: Flags) -> int:
    """This node's rank, once `FLAG_RULES` passed."""
    rank, problem = _node_rank(f)
    if rank is None:
        raise ConfigError(problem)
    return rank


def rank_known(f: Flags) -> str | None:
    return _node_rank(f)[1]


def overrides_are_key_value(f: Flags) -> str | None:
    for o in f.overrides:
        if "=" not in o or o.startswith("="):
            return f"unexpected argument {o!r}: config overrides are key=value, e.g. train.lr=1e-4"
    return None


FLAG_RULES: tuple[Rule, ...] = (
    Rule("bench-options-need-bench", bench_options_need_bench),
    Rule("bench-takes-no-rl-flags", bench_takes_no_rl_flags),
    Rule("job-selected", job_selected),
    Rule("eval-interval-given", eval_interval_given, needs=("job-selected",)),
    Rule("num-nodes-positive", num_nodes_positive),
    Rule("rank-weights", rank_weights, needs=("num-nodes-positive",)),
    Rule("rank-known", rank_known, needs=("num-nodes-positive",)),
    Rule("overrides-are-key-value", overrides_are_key_value),
)


