"""Worked episodes: an environment's own solution played against it, written as chat examples
for an SFT warm start (train/sft_data.py reads them; the loss falls on the assistant turns).

    python -m rollout.envs.worked --env calculator --tasks DIR/train.jsonl --out DIR/worked.jsonl --count 200

A solver gives the next assistant turn from the task and the conversation so far; a built-in
environment brings its own (SOLVERS), a custom one names it with `--solver module:function`.
Every episode is played through the environment's `reset` and `step`, so the observations are
the environment's own, and one that does not end done with at least `--success` reward stops
the command: a worked episode that fails would teach the failure.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

import click

from coordination.records import publish_bytes, restrict_umask
from rollout.envs import BUILTIN, EnvError, check_messages, check_step, load_env
from rollout.tasks import TaskFileError, load_tasks

SOLVERS = {"calculator": "rollout.envs.calculator:worked_turn"}

Solver = Callable[[Any, list], str]


def play(factory: Callable[[Any], Any], solver: Solver, task: Any, *, max_turns: int,
         success: float) -> list[dict[str, str]]:
    """The messages of one worked episode: the environment's first messages, then each solver
    turn followed by the environment's answer to it. ValueError when it does not solve the task."""
    env = factory(task)
    try:
        messages = check_messages(env.reset(), "reset()")
        reward, turns = 0.0, 0
        while turns < max_turns:
            text = solver(task, messages)
            turns += 1
            step = check_step(env.step(text))
            messages = messages + [{"role": "assistant", "content": text}] + step.messages
            reward += step.reward or 0.0
            if step.done:
                break
        else:
            raise ValueError(f"the solver did not finish task {task['id']!r} within {max_turns} turns")
    finally:
        if callable(getattr(env, "close", None)):
            env.close()
    if reward < success:
        raise ValueError(f"the solver earned reward {reward:g} on task {task['id']!r}, below --success {success:g}; "
                         f"a worked episode must solve its task")
    return messages


def load_solver(env: str, spec: str | None) -> Solver:
    spec = spec or SOLVERS.get(env)
    if spec is None:
        raise click.UsageError(f"--env {env} has no built-in solver (built-in: {', '.join(SOLVERS)}); pass "
                               f"--solver module:function (task, messages) -> the next assistant text")
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr, None) if module_name and attr else None
    except ImportError as exc:
        raise click.UsageError(f"--solver {spec}: cannot import {module_name!r} ({exc}); fix the name") from None
    if not callable(fn):
        raise click.UsageError(f"--solver {spec} names no function; give module:function")
    return fn


@click.command()
@click.option("--env", "env_spec", required=True,
              help=f"the environment: {', '.join(BUILTIN)} or module:factory (as tasks.env)")
@click.option("--tasks", "tasks_path", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="task JSONL; the first --count tasks are played")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True, help="JSONL to write")
@click.option("--count", type=click.IntRange(1), default=200, show_default=True, help="worked episodes to write")
@click.option("--solver", default=None, help="module:function giving the next assistant turn (task, messages)")
@click.option("--max-turns", type=click.IntRange(1), default=8, show_default=True)
@click.option("--success", type=float, default=1.0, show_default=True, help="least reward a worked episode earns")
def main(env_spec: str, tasks_path: Path, out: Path, count: int, solver: str | None, max_turns: int,
         success: float) -> None:
    """Write worked episodes ({"id", "messages"} per line) of an environment for SFT."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    try:
        factory = load_env(env_spec)
        tasks = load_tasks(tasks_path)
    except (EnvError, TaskFileError) as exc:
        raise click.UsageError(str(exc)) from None
    if len(tasks) < count:
        raise click.UsageError(f"--count {count} is more than the {len(tasks)} tasks in {tasks_path}; lower --count")
    solve = load_solver(env_spec, solver)
    lines = []
    for task in tasks[:count]:
        try:
            messages = play(factory, solve, task, max_turns=max_turns, success=success)
        except ValueError as exc:  # EnvError too: the environment returned the wrong types
            raise click.ClickException(f"{exc}; fix the solver or the task") from None
        lines.append(json.dumps({"id": task.id, "messages": messages}, ensure_ascii=False) + "\n")
    publish_bytes(out, "".join(lines).encode("utf-8"))
    click.echo(f"wrote {len(lines)} worked {env_spec} episodes to {out}")


if __name__ == "__main__":
    main()
