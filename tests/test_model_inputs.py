"""The starting model is checked against the inputs at dry run and join, before the run folder is
written: model.path must hold a config.json transformers loads, rollout.max_new_tokens must leave
room for a prompt, and every prompt must fit the model's positions with max_new_tokens after it."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordination.config import ConfigError
from rl.model_inputs import check_max_new_tokens, check_prompt_lengths, load_model_config, model_context
from rollout.tasks import Task, arithmetic_tasks, write_tasks
from tests.e2e import RUN_SH
from tests.procs import ROOT, env
from train.tiny import write_tiny_model

LONG = Task(id="long-one", prompt="1+" * 150 + "2=", answer="3")   # 302 characters, one token each


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", layers=1, max_positions=256)


@pytest.fixture
def data(tmp_path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    train, ev = arithmetic_tasks(64, 8, digits=2, seed=1)
    write_tasks(folder / "train.jsonl", train)
    write_tasks(folder / "eval.jsonl", ev)
    return folder


def test_a_model_path_without_a_loadable_config_json_is_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"^model.path={tmp_path} holds no config.json; give a Hugging Face"):
        load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ConfigError, match=rf"^model.path={tmp_path}: config.json cannot be loaded \("):
        load_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json cannot be loaded"):
        load_model_config(str(tmp_path))


def test_max_new_tokens_must_leave_room_for_a_prompt(model):
    context = model_context(load_model_config(str(model)))
    assert context == 256
    check_max_new_tokens(255, context)
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=256 leaves no room for a prompt in the model's "
                                          r"256 positions \(max_position_embeddings"):
        check_max_new_tokens(256, context)
    with pytest.raises(ConfigError, match=r"in inference.vllm.max_model_len=64; lower rollout.max_new_tokens below 64"):
        check_max_new_tokens(64, model_context(load_model_config(str(model)), 64), 64)


def test_the_longest_prompt_is_named_with_its_file_and_length(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    short = Task(id="short", prompt="1+2=", answer="3")
    check_prompt_lengths(tok, [short], Path("train.jsonl"), 8, 256)
    with pytest.raises(ConfigError, match=r"^task 'long-one' of train.jsonl has a prompt of 30\d tokens: with "
                                          r"rollout.max_new_tokens=8 it needs 3\d\d positions, more than the model's "
                                          r"256 positions"):
        check_prompt_lengths(tok, [short, LONG], Path("train.jsonl"), 8, 256)


def _run_sh(data: Path, log: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [RUN_SH, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both", "--eval-interval", "1",
           f"model.path={model}", "tasks.reward=tests.e2e_rewards:starts_with_digit", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # two run.sh processes that import transformers: 15-25 s on 2 loaded cores
@pytest.mark.parametrize("case", ["long prompt", "max_new_tokens", "no config.json"])
def test_a_start_and_its_dry_run_refuse_before_the_run_folder_is_written(tmp_path, data, model, case):
    extra: tuple[str, ...] = ()
    if case == "long prompt":
        with open(data / "eval.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"id": LONG.id, "prompt": LONG.prompt, "answer": LONG.answer}) + "\n")
        says = f"task 'long-one' of {data / 'eval.jsonl'} has a prompt of"
    elif case == "max_new_tokens":
        extra, says = ("rollout.max_new_tokens=300",), "rollout.max_new_tokens=300 leaves no room for a prompt"
    else:
        model = tmp_path / "empty-model"
        model.mkdir()
        says = f"model.path={model} holds no config.json"
    log = tmp_path / "run"
    log.mkdir(mode=0o750)
    dry = _run_sh(data, log, model, "--dry-run", *extra)
    assert dry.returncode == 2 and says in dry.stderr, dry.stderr[-2000:]
    res = _run_sh(data, log, model, *extra)
    assert res.returncode == 2, res.stderr[-2000:]
    assert says in res.stderr and "Traceback" not in res.stderr
    assert list(log.iterdir()) == [], "the run folder was written before the model was checked"
