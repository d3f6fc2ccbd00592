"""Tasks: JSONL task files and the built-in generators of verifiable task sets (docs/design.md §7).

A task file has one JSON object per line: `{"id": ..., "prompt": ..., "answer": ..., ...}`. A
chat task may give `messages` (a list of {"role", "content"}) instead of, or beside, `prompt`;
then the chat template builds the prompt (rollout/prompts.py). Every other key is kept in
`Task.extra` for custom reward functions. A bad line is reported with file, line number and
what is wrong, and so is an id used twice.

    python -m rollout.tasks make --kind arithmetic --out DIR --train 5000 --eval 500 --digits 3 --ops +,-
    python -m rollout.tasks make --kind calculator --out DIR --ops '*'   (questions for tasks.env=calculator)
    python -m rollout.tasks check DIR/train.jsonl
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import click

from coordination.records import publish_bytes, restrict_umask

REQUIRED = ("id", "answer")
ARITHMETIC_OPS = ("+", "-", "*")


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class Task:
    """One verifiable task. `prompt` is the plain-text prompt (for chat tasks without one, the
    messages rendered as `role: content` lines, for people and reports)."""

    id: str
    prompt: str
    answer: str
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    # Mapping-style access, so `encode_prompt(tokenizer, task)` and reward functions written
    # for plain dicts accept a Task as well.
    def __getitem__(self, key: str) -> Any:
        if key in ("id", "prompt", "answer", "messages"):
            return getattr(self, key)
        return self.extra[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "prompt": self.prompt, "answer": self.answer}
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        out.update(self.extra)
        return out


def _scalar_text(value: Any, key: str) -> str:
    # JSON numbers are common for ids and numeric answers; keep their canonical text.
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        raise ValueError(f"{key!r} must be a string or a number (got {json.dumps(value)})")
    return value if isinstance(value, str) else json.dumps(value)


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content' (got {json.dumps(m)})")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def parse_task(obj: Any) -> Task:
    """A Task from one decoded JSON line; ValueError says what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, found {type(obj).__name__}")
    missing = [k for k in REQUIRED if k not in obj]
    if "prompt" not in obj and "messages" not in obj:
        missing.append("prompt (or messages)")
    if missing:
        raise ValueError(f"missing field {', '.join(missing)}; every line needs id, prompt (or messages) and answer")
    task_id = _scalar_text(obj["id"], "id")
    if not task_id.strip():
        raise ValueError("'id' is empty")
    messages = _messages(obj["messages"]) if obj.get("messages") is not None else None
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"'prompt' must be a non-empty string (got {json.dumps(obj['prompt'])})")
        prompt = obj["prompt"]
    elif messages is not None:
        prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    else:
        raise ValueError("'messages' is null and there is no 'prompt'")
    answer = _scalar_text(obj["answer"], "answer")
    extra = {k: v for k, v in obj.items() if k not in ("id", "prompt", "answer", "messages")}
    return Task(id=task_id, prompt=prompt, answer=answer, messages=messages, extra=extra)


def iter_tasks(path: Path) -> Iterator[tuple[int, Task]]:
    """(line number, task) for every non-blank line of a JSONL file."""
    path = Path(path)
    try:
        fh = open(path, "rb")  # bytes: each line is decoded below, so a bad byte is reported with its line
    except FileNotFoundError:
        raise TaskFileError(f"task file {path} does not exist; check --data-path and tasks.train_file/eval_file") from None
    except IsADirectoryError:
        raise TaskFileError(f"task file {path} is a folder; give a JSONL file (one task per line)") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TaskFileError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start:exc.start + 1]!r} at "
                                    f"column {exc.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            try:
                yield lineno, parse_task(obj)
            except ValueError as exc:
                raise TaskFileError(f"{path}:{lineno}: {exc}") from None


def load_tasks(path: Path) -> list[Task]:
    """Every task of a JSONL file, in file order. Raises TaskFileError (file:line: problem) for a
    bad line, a repeated id or a file without tasks."""
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for lineno, task in iter_tasks(path):
        if task.id in first_line:
            raise TaskFileError(f"{path}:{lineno}: id {task.id!r} was already used on line {first_line[task.id]}; "
                                f"task ids must be unique within a file")
        first_line[task.id] = lineno
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"task file {path} holds no tasks")
    return tasks


def write_tasks(path: Path, tasks: list[Task]) -> None:
    text = "".join(json.dumps(t.to_json(), ensure_ascii=False) + "\n" for t in tasks)
    publish_bytes(Path(path), text.encode("utf-8"))


# -- generators -------------------------------------------------------------------------------

def arithmetic_tasks(n_train: int, n_eval: int, *, digits: int = 3, ops: tuple[str, ...] = ("+",),
                     seed: int = 0) -> tuple[list[Task], list[Task]]:
    """Disjoint train and eval sets of `a<op>b=` problems with operands of up to `digits` digits.

    Problems are drawn without replacement from the whole problem space (every op and operand
    pair), so no prompt appears twice or in both splits."""
    if digits < 1:
        raise ValueError(f"--digits must be at least 1 (got {digits})")
    bad = [op for op in ops if op not in ARITHMETIC_OPS]
    if bad or not ops:
        raise ValueError(f"--ops must be a comma-separated subset of {','.join(ARITHMETIC_OPS)} (got {','.join(ops)})")
    if n_train < 0 or n_eval < 0:
        raise ValueError("--train and --eval must not be negative")
    ops = tuple(dict.fromkeys(ops))
    side = 10 ** digits
    space = len(ops) * side * side
    if n_train + n_eval > space:
        raise ValueError(f"only {space} distinct problems exist with --digits {digits} --ops {','.join(ops)}; "
                         f"ask for fewer than {n_train + n_eval} or raise --digits")
    picks = random.Random(seed).sample(range(space), n_train + n_eval)

    def make(index: int, split: str, i: int) -> Task:
        op_i, rest = divmod(index, side * side)
        a, b = divmod(rest, side)
        op = ops[op_i]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Task(id=f"{split}-{i:06d}", prompt=f"{a}{op}{b}=", answer=str(value),
                    extra={"kind": "arithmetic", "digits": digits, "op": op})

    train = [make(p, "train", i) for i, p in enumerate(picks[:n_train])]
    evals = [make(p, "eval", i) for i, p in enumerate(picks[n_train:])]
    return train, evals


def calculator_tasks(n_train: int, n_eval: int, *, digits: int = 3, ops: tuple[str, ...] = ("*",),
                     seed: int = 0) -> tuple[list[Task], list[Task]]:
    """The arithmetic problems asked as questions for the `calculator` environment
    (`What is 17*23?`), each with its `expression`, which the environment's worked episodes send
    to the tool (rollout/envs/worked.py)."""
    def ask(task: Task) -> Task:
        expression = task.prompt.removesuffix("=")
        return Task(id=task.id, prompt=f"What is {expression}?", answer=task.answer,
                    extra={**task.extra, "kind": "calculator", "expression": expression})

    train, evals = arithmetic_tasks(n_train, n_eval, digits=digits, ops=ops, seed=seed)
    return [ask(t) for t in train], [ask(t) for t in evals]


GENERATORS = {"arithmetic": arithmetic_tasks, "calculator": calculator_tasks}


@click.group()
def main() -> None:
    """Task files: make built-in task sets, check a JSONL file."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)


@main.command()
@click.option("--kind", type=click.Choice(sorted(GENERATORS)), default="arithmetic", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="folder for train.jsonl and eval.jsonl")
@click.option("--train", "n_train", type=int, default=5000, show_default=True, help="number of train tasks")
@click.option("--eval", "n_eval", type=int, default=500, show_default=True, help="number of eval tasks")
@click.option("--digits", type=int, default=3, show_default=True, help="operands have up to this many digits")
@click.option("--ops", default="+", show_default=True, help="comma-separated operations among + - *")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="replace existing train.jsonl/eval.jsonl in --out")
def make(kind: str, out: Path, n_train: int, n_eval: int, digits: int, ops: str, seed: int, overwrite: bool) -> None:
    """Write a verifiable task set: OUT/train.jsonl and OUT/eval.jsonl (disjoint)."""
    targets = [out / "train.jsonl", out / "eval.jsonl"]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not overwrite:
        raise click.UsageError(f"{', '.join(existing)} already exist; pass --overwrite or choose another --out")
    try:
        train, evals = GENERATORS[kind](n_train, n_eval, digits=digits,
                                        ops=tuple(o.strip() for o in ops.split(",") if o.strip()), seed=seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    write_tasks(targets[0], train)
    write_tasks(targets[1], evals)
    click.echo(f"wrote {len(train)} train and {len(evals)} eval {kind} tasks to {out}")


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
def check(files: tuple[Path, ...]) -> None:
    """Validate task files; exits non-zero with file:line: problem on the first bad line."""
    for path in files:
        try:
            tasks = load_tasks(path)
        except TaskFileError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{path}: {len(tasks)} tasks, ok")


if __name__ == "__main__":
    main()
