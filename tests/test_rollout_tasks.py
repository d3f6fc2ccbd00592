"""Task files and the arithmetic generator."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.tasks import Task, TaskFileError, arithmetic_tasks, load_tasks

REPO = Path(__file__).resolve().parents[1]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_load_tasks_keeps_fields_messages_and_extra_keys(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        json.dumps({"id": "a", "prompt": "1+1=", "answer": "2", "level": 3}),
        "",
        json.dumps({"id": 7, "messages": [{"role": "user", "content": "2+2?"}], "answer": 4}),
    ])
    a, b = load_tasks(path)
    assert (a.id, a.prompt, a.answer, a.messages, a.extra) == ("a", "1+1=", "2", None, {"level": 3})
    assert (b.id, b.answer) == ("7", "4")
    assert b.messages == ({"role": "user", "content": "2+2?"},)
    assert b.prompt == "user: 2+2?\n"
    assert b["answer"] == "4" and a["level"] == 3 and a.get("missing", "x") == "x"


@pytest.mark.parametrize("line, problem", [
    ('{"id": "a", "prompt": "x", "answer": "1"', "not valid JSON"),
    ('{"id": "a", "answer": "1"}', "missing field prompt (or messages)"),
    ('{"prompt": "x", "answer": "1"}', "missing field id"),
    ('{"id": "a", "prompt": "x"}', "missing field answer"),
    ('["a", "x", "1"]', "expected a JSON object, found list"),
    ('{"id": "a", "prompt": 5, "answer": "1"}', "'prompt' must be a non-empty string"),
    ('{"id": "a", "prompt": "x", "answer": null}', "'answer' must be a string or a number"),
    ('{"id": true, "prompt": "x", "answer": "1"}', "'id' must be a string or a number"),
    ('{"id": "a", "messages": [{"role": "user"}], "answer": "1"}', "messages[0] must be an object"),
])
def test_bad_task_line_is_reported_with_file_line_and_problem(tmp_path, line, problem):
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"id": "ok", "prompt": "1+1=", "answer": "2"}), line])
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    assert str(err.value).startswith(f"{path}:2: ")
    assert problem in str(err.value)


def test_duplicate_task_id_names_both_lines(tmp_path):
    row = json.dumps({"id": "same", "prompt": "1+1=", "answer": "2"})
    path = write_lines(tmp_path / "dup.jsonl", [row, json.dumps({"id": "other", "prompt": "x", "answer": "1"}), row])
    with pytest.raises(TaskFileError, match=r"dup.jsonl:3: id 'same' was already used on line 1"):
        load_tasks(path)


def test_missing_and_empty_task_files_are_errors(tmp_path):
    with pytest.raises(TaskFileError, match="does not exist"):
        load_tasks(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TaskFileError, match="holds no tasks"):
        load_tasks(tmp_path / "empty.jsonl")


def test_arithmetic_answers_are_correct_and_prompts_compact():
    train, evals = arithmetic_tasks(300, 100, digits=2, ops=("+", "-", "*"), seed=1)
    for t in train + evals:
        assert t.prompt.endswith("=") and " " not in t.prompt
        assert str(eval(t.prompt[:-1])) == t.answer  # noqa: S307 - our own generated digits and ops
        a, b = (int(x) for x in t.prompt[:-1].replace("*", "+").replace("-", "+").split("+"))
        assert 0 <= a < 100 and 0 <= b < 100
    assert {t.extra["op"] for t in train} == {"+", "-", "*"}


def test_arithmetic_train_and_eval_are_disjoint_and_seeded():
    # 250 of the 300 one-digit problems: a space small enough that careless sampling would collide.
    train, evals = arithmetic_tasks(200, 50, digits=1, ops=("+", "-", "*"), seed=3)
    prompts = [t.prompt for t in train + evals]
    assert len(set(prompts)) == 250
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert len({t.id for t in train + evals}) == 250
    again, _ = arithmetic_tasks(200, 50, digits=1, ops=("+", "-", "*"), seed=3)
    other, _ = arithmetic_tasks(200, 50, digits=1, ops=("+", "-", "*"), seed=4)
    assert [t.prompt for t in again] == [t.prompt for t in train]
    assert [t.prompt for t in other] != [t.prompt for t in train]


def test_arithmetic_refuses_more_problems_than_exist():
    with pytest.raises(ValueError, match="only 100 distinct problems exist"):
        arithmetic_tasks(90, 20, digits=1, ops=("+",))
    with pytest.raises(ValueError, match="subset of"):
        arithmetic_tasks(1, 1, ops=("/",))


def test_make_command_writes_loadable_disjoint_files_and_refuses_overwrite(tmp_path):
    cmd = [sys.executable, "-m", "rollout.tasks", "make", "--kind", "arithmetic", "--out", str(tmp_path),
           "--train", "50", "--eval", "10", "--digits", "2", "--ops", "+,-", "--seed", "5"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    train, evals = load_tasks(tmp_path / "train.jsonl"), load_tasks(tmp_path / "eval.jsonl")
    assert (len(train), len(evals)) == (50, 10)
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert {t.extra["op"] for t in train} <= {"+", "-"}
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert again.returncode != 0 and "--overwrite" in again.stderr
    check = subprocess.run([sys.executable, "-m", "rollout.tasks", "check", str(tmp_path / "train.jsonl")],
                           cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0 and "50 tasks" in check.stdout


def test_task_round_trips_through_json():
    t = Task(id="x", prompt="p", answer="1", messages=({"role": "user", "content": "hi"},), extra={"k": [1]})
    assert json.loads(json.dumps(t.to_json())) == {"id": "x", "prompt": "p", "answer": "1",
                                                   "messages": [{"role": "user", "content": "hi"}], "k": [1]}


def test_non_utf8_bytes_are_reported_with_file_and_line_not_a_bare_decode_error(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"id": "a", "prompt": "1+1=", "answer": "2"}).encode()
    path.write_bytes(good + b"\n" + b'{"id": "b", "prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(TaskFileError) as err:
        load_tasks(path)
    assert str(err.value).startswith(f"{path}:2: not UTF-8 text") and "UTF-8" in str(err.value)
