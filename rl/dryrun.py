"""`scripts/run.sh ... --dry-run`: show what this node would do, touching nothing.

Prints the resolved config, this rank's phase plan, the task split per rank for the next
iteration, the exact inference-server and torchrun commands (the rendezvous port is chosen by the
master at phase 9, so it is shown as a placeholder), the GPU memory plan and one checkpoint's
bytes on disk. Reads the log path if a run is there -- where the job stands (finished, or the
iteration and phase this rank last reported) and how this command's config differs from the
recorded one -- but never writes to it.

It is given the failures of every input rule (rl/validate: flags, model, trainer launch, task
files, reward, secrets, GPU memory), checks the log path as a start would, prints every failure
beside the plan and exits 2 where a start would refuse, so one dry run shows every problem at once.
"""
from __future__ import annotations

import shlex
from pathlib import Path

import click

from coordination.config import MASK, ConfigError, differences, dump_yaml, is_secret_name, to_dict
from coordination.layout import RunLayout
from coordination.manifest import NODE_LOCAL_KEYS, JoinRefused, check_log_path_safe, master_address, read_config_yaml
from coordination.phases import BY_NUMBER, phase_name
from coordination.records import read_or_none
from rl.plan import RUNS_WHEN, job_plan
from rollout.engines.vllm_server import build_server
from rollout.inference import resolve_dtype
from train.checkpoint_size import checkpoint_size, format_checkpoint_size
from train.context_rules import context_mesh_line
from train.memory_plan import engine_on_gpu, format_plan, gpu_visible, make_plan as make_memory_plan
from train.mesh_layout import mesh_line
from train.model_shape import ModelShape


def standing(layout: RunLayout, args, cfg) -> tuple[int, list[str], bool]:
    """(next iteration, lines saying where the recorded run stands, whether the job is finished)."""
    run = read_or_none(layout.run_json, kind="run")
    if run is None:
        who = "creates it" if args.is_master else "waits for the master to create it"
        return 1, [f"no run in {layout.root} yet: this command {who}"], False
    lines = [f"run {run.run_id} in {layout.root}"]
    prog = read_or_none(layout.job(args.kind.name).progress_json, kind="progress", run_id=run.run_id)
    done = int(prog.data.get("completed_iteration", 0)) if prog else 0
    finished = bool(prog and prog.data.get("stopped"))
    if finished:
        lines.append(f"job {args.kind.name} is finished: it stopped after iteration {done} ({prog.data['stopped']}). "
                     f"Running this command again does nothing.")
    else:
        beat = read_or_none(layout.job(args.kind.name).heartbeat(args.rank), kind="heartbeat", run_id=run.run_id)
        at = f"job {args.kind.name} is at iteration {done + 1}"
        if beat is not None and beat.data.get("iteration") is not None:
            d = beat.data
            at += (f"; rank {args.rank} last reported iteration {d['iteration']}, phase {d.get('phase')} "
                   f"{phase_name(d.get('phase'))} ({d.get('state', '?')}: {d.get('message', '')})")
        lines.append(at)
    recorded = read_config_yaml(layout)
    if recorded is not None:
        diff = differences(recorded, to_dict(cfg), NODE_LOCAL_KEYS)
        if diff:
            lines.append(f"this command's config differs from the recorded run in {len(diff)} key(s) "
                         f"(recorded -> this command); the run refuses it unless started with --resume:")
            lines += [f"  {d}" for d in diff]
        else:
            lines.append("this command's config matches the recorded run")
    return done + 1, lines, finished


def dry_run(args, cfg, problems: list) -> int:
    """Print the plan and `problems` (rl/validate failures); 2 if there are any, else 0."""
    echo = click.echo
    layout = RunLayout(args.log_path)
    it, where, finished = standing(layout, args, cfg)
    role = "master" if args.is_master else f"worker {args.rank}"
    echo(f"# dry run: job {args.kind.name}, {role} of {args.num_nodes} node(s); nothing is written")
    echo("\n## where the run stands\n")
    echo("\n".join(where))
    refused = _refusals(args, problems)
    if finished:
        return _verdict(refused)
    echo(f"\nnext iteration: {it}")
    echo("\n## resolved config\n")
    echo(dump_yaml(cfg))

    plan = job_plan(args, cfg)
    kind = plan.kind
    echo("## inputs\n")
    for message in refused:
        echo(f"  refused: {message}")
    if not refused:
        echo("  every input rule passed (rl/validate), and the log path is safe (docs/design.md §5 rule 10)")

    echo("\n## phase plan of this rank (iteration %d)\n" % it)
    for n in kind.phases:
        spec = BY_NUMBER[n]
        acts = spec.who == "all" or args.is_master
        note = []
        if not plan.runs(n, it):
            note.append(f"skipped in iteration {it}: RunPlan.{RUNS_WHEN[n]} is false")
        echo(f"  {n:2d} {spec.name:24s} {'acts' if acts else 'waits':5s} {'barrier' if spec.barrier else '':7s} "
             f"{spec.summary}{' (' + '; '.join(note) + ')' if note else ''}")

    splits = [s for s, on in (("train", plan.rolls_out_in(it)), ("eval", plan.evaluates_in(it))) if on]
    if splits:
        echo("\n## task split for iteration %d (rank weights %s)\n" % (it, args.rank_weights))
    for split in splits:
        try:
            shares = plan.shares(split, it)
        except Exception as exc:  # noqa: BLE001 - a dry run reports what would fail
            echo(f"  {split}: cannot split: {exc}")
            continue
        for r, share in enumerate(shares):
            first = ", ".join(t.id for t in share[:3])
            echo(f"  {split} rank {r}: {len(share)} tasks{' <- this node' if r == args.rank else ''}"
                 f"{f' (first: {first})' if first else ''}")

    echo("\n## commands this node would run\n")
    inf = cfg.inference
    policy = Path(cfg.model.path) if it == 1 else layout.checkpoint(it - 1)
    if kind.serves:
        if inf.engine == "vllm":
            if args.debug_mode:
                echo(f"  inference: the server you run at {inf.vllm.debug_url} (--debug-mode: never started here)")
            else:
                try:
                    spec = build_server(inf.vllm, policy, port=inf.vllm.port or 0, rank=args.rank, restart_count=0,
                                        temperature=cfg.rollout.temperature,
                                        dtype=resolve_dtype(inf, on_gpu=not inf.vllm.cpu),
                                        between_iterations=inf.between_iterations, cache_root=None)
                except ConfigError as exc:  # an unset env: reference; the inputs section says so too
                    echo(f"  inference server: cannot be built: {exc}")
                else:
                    env = " ".join(f"{k}={shlex.quote(MASK if is_secret_name(k) else v)}"
                                   for k, v in sorted(spec.env.items()) if k != "VLLM_API_KEY")
                    echo(f"  inference server: {env} {shlex.join(spec.argv)}")
                if inf.vllm.port == 0:
                    echo("    (--port 0: a free port is picked when the server starts)")
        else:
            echo(f"  inference: transformers engine in this process (device {inf.device}, dtype {inf.dtype}) "
                 f"on {policy}")
    if kind.trains:
        addr = master_address(cfg.coordination.master_addr)
        cmd = plan.torchrun_argv(layout, it, 1, args.rank, endpoint=f"{addr}:29500", rdzv_id=f"RUN-{kind.name}-i{it}-a1",
                                is_host=args.is_master, local_addr=addr if args.is_master else "THIS_NODE_ADDR")
        text = shlex.join(cmd).replace(f"{addr}:29500", f"{addr}:PORT")
        echo(f"  training (phase 10): {text}")
        echo(f"    {mesh_line(cfg.train, args.num_nodes * cfg.train.nproc_per_node)}")
        if cfg.train.cp > 1:
            echo(f"    ({context_mesh_line(cfg.train, args.num_nodes)})")
        echo("    (PORT and the rendezvous id are chosen by the master and sent in a GO: phase 0's for a resident "
                 "trainer's first launch, else phase 9's)")
        if plan.resident_trainer:
            echo("    (train.resident: launched once, at phase 0 so that it starts during the rollouts, and kept "
                 "across iterations; each iteration's plan reaches it as an order record, docs/design.md §9.6)")
        if args.kind.benchmarks:
            echo(f"    ({layout.job(kind.name).bench_config(args.rank)} holds this run's `train` section)")
    if not memory_plan(args, cfg, kind) and kind.trains:
        disk_use(cfg)
    return _verdict(refused)


def _refusals(args, problems: list) -> list[str]:
    """Every input rule that failed, and the log path checks of a start that write nothing."""
    # The rule's name leads, so a refusal can be looked up in rl/validate's table.
    refused = [f"{p.rule}: {p}" if hasattr(p, "rule") else str(p) for p in problems]
    try:
        check_log_path_safe(args.log_path)
    except JoinRefused as exc:
        refused.append(str(exc))
    return refused


def _verdict(refused: list[str]) -> int:
    if not refused:
        return 0
    click.echo(f"\na start with this command would stop here (exit 2), {len(refused)} problem(s):", err=True)
    for message in refused:
        click.echo(f"  {message}", err=True)
    return 2


def memory_plan(args, cfg, kind) -> bool:
    """The GPU memory plan (docs/design.md §10.5), when there is a GPU to plan for; whether it was
    printed (it shows the checkpoint's disk use too)."""
    if not (engine_on_gpu(cfg, args.debug_mode) or cfg.train.gpu_memory_gib):
        return False
    click.echo("\n## memory plan per GPU\n")
    try:
        plan = make_memory_plan(cfg, serves=kind.serves, trains=kind.trains, num_nodes=args.num_nodes,
                                debug_mode=args.debug_mode)
    except ConfigError as exc:
        click.echo(f"  no plan: {exc}")
        return False
    if plan is None:
        click.echo("  no GPU on this node: set train.gpu_memory_gib (e.g. 80) to see the plan")
        return False
    click.echo(format_plan(plan))
    return True


def disk_use(cfg) -> None:
    """One checkpoint's bytes on disk (docs/design.md §11.4), for a job that trains."""
    click.echo("\n## checkpoint disk use\n")
    try:
        shape = ModelShape.from_model_dir(Path(cfg.model.path))
    except ConfigError as exc:
        click.echo(f"  not estimated: {exc}")
        return
    click.echo("\n".join(format_checkpoint_size(checkpoint_size(shape, cfg.train, on_gpu=gpu_visible()))))
