"""The `calculator` environment: a tool call, its result, then the answer.

The model may write `<calc>17*23</calc>`; the environment answers with a `tool` message holding
the result (or the reason it could not compute it) and the episode goes on. A turn without a
tool call is the answer: its last number is compared with the task's `answer` (reward 1.0 or
0.0) and the episode ends. Expressions are integers and decimals with + - * / and parentheses,
evaluated from their syntax tree (never `eval`), so a model cannot run code through the tool.

`worked_turn` is the environment's own solution, turn by turn (send the task's expression to
the tool, then answer with the tool's result): rollout/envs/worked.py plays it against the
environment to write the worked episodes an SFT warm start learns from.
"""
from __future__ import annotations

import ast
import operator
import re
from typing import Any

from rollout.envs import Step

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION = 200  # characters: a tool call is arithmetic, not a program


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text; ValueError says why there is none."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression.strip()!r}") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"only numbers, + - * / and parentheses are allowed (got {ast.dump(node)[:40]})")

    result = value(tree.body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


def final_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[-1] if found else None


class Calculator:
    def __init__(self, task: Any):
        self.task = task

    def reset(self) -> list[dict[str, str]]:
        messages = self.task.get("messages")
        return [dict(m) for m in messages] if messages else [{"role": "user", "content": self.task["prompt"]}]

    def step(self, text: str) -> Step:
        call = CALL.search(text)
        if call is not None:
            try:
                result = evaluate(call.group(1))
            except ValueError as exc:
                result = f"error: {exc}"
            return Step([{"role": "tool", "content": result}], None, False)
        answer = final_number(text)
        solved = answer is not None and float(answer) == float(self.task["answer"])
        return Step([], 1.0 if solved else 0.0, True)


def worked_turn(task: Any, messages: list[dict[str, str]]) -> str:
    """The next assistant turn of a worked episode: the tool call of the task's `expression`,
    then, once the tool has answered, its result as the answer."""
    if messages and messages[-1]["role"] == "tool":
        return messages[-1]["content"]
    expression = task.get("expression")
    if not isinstance(expression, str) or not expression:
        raise ValueError(f"task {task['id']!r} has no 'expression' to send to the tool; make calculator tasks with "
                         f"`python -m rollout.tasks make --kind calculator`")
    return f"<calc>{expression}</calc>"
