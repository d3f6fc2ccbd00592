"""SFT: data shapes, one process, and two nodes evaluating in lockstep."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import train_support as ts
from coordination.records import read_record
from coordination.checkpoints import is_complete


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return ts.make_tiny(tmp_path_factory.mktemp("base") / "tiny", layers=2)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    from rollout.tasks import arithmetic_tasks, write_tasks

    out = tmp_path_factory.mktemp("tasks")
    train, evals = arithmetic_tasks(400, 40, digits=2, seed=0)
    write_tasks(out / "train.jsonl", train)
    write_tasks(out / "eval.jsonl", evals)
    return out


def test_examples_accept_tasks_prompt_completion_and_chat_with_eos_appended(base, tmp_path):
    from transformers import AutoTokenizer

    from train.sft_data import SFTDataError, load_examples

    tok = AutoTokenizer.from_pretrained(str(base))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"id": "a", "prompt": "1+2=", "answer": 3},
        {"prompt": "say hi", "completion": "hi"},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    ]) + "\n")
    a, b, c = load_examples(path, tok)
    assert a.prompt_ids == tok("1+2=")["input_ids"] and a.completion_ids == tok.encode("3", add_special_tokens=False) + [2]
    assert b.completion_ids == tok.encode("hi", add_special_tokens=False) + [2]
    assert tok.decode(c.prompt_ids) .endswith("user: 2+2?\nassistant: ")
    assert c.completion_ids == tok.encode("4", add_special_tokens=False) + [2]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(SFTDataError, match=r"bad.jsonl:1: unknown shape.*accepted lines"):
        load_examples(bad, tok)


def test_sft_lowers_the_loss_and_writes_a_checkpoint_transformers_loads(base, tasks, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft"
    rc = ts.run_module("train.sft", ["--model", str(base), "--data", str(tasks / "train.jsonl"), "--out", str(out),
                                     "--eval-data", str(tasks / "eval.jsonl"), "--eval-every", "20",
                                     "--steps", "40", "--batch-size", "32"], tmp_path / "sft.log")
    assert rc == 0, (tmp_path / "sft.log").read_text()
    assert is_complete(out) and not (out / "optimizer").exists()
    AutoModelForCausalLM.from_pretrained(str(out))
    state = read_record(out / "trainer_state.json").data
    losses = [loss for _, loss in state["sft"]["loss"]]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    assert [step for step, _ in state["sft"]["eval_accuracy"]] == [20, 40]


def test_sft_refuses_a_target_without_eval_data_and_an_existing_output(base, tasks, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("keep me")
    args = ["--model", str(base), "--data", str(tasks / "train.jsonl")]
    assert ts.run_module("train.sft", args + ["--out", str(tmp_path / "o"), "--target-accuracy", "0.2"],
                         tmp_path / "a.log", timeout=60) == 2
    assert "--target-accuracy needs --eval-data" in (tmp_path / "a.log").read_text()
    assert ts.run_module("train.sft", args + ["--out", str(out)], tmp_path / "b.log", timeout=60) == 2
    assert "already exists and is not empty" in (tmp_path / "b.log").read_text()
    assert (out / "x").read_text() == "keep me"


@pytest.mark.slow
def test_sft_on_two_nodes_evaluates_in_lockstep_and_stops_on_the_target(base, tasks, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "sft2"
    # Target 0: the first eval (step 5) reaches it on every rank, so both stop there together.
    codes = ts.torchrun("train.sft", ["--model", str(base), "--data", str(tasks / "train.jsonl"), "--out", str(out),
                                      "--eval-data", str(tasks / "eval.jsonl"), "--eval-every", "5",
                                      "--target-accuracy", "0", "--steps", "50", "--batch-size", "32",
                                      "--save-optimizer"], tmp_path / "logs")
    assert codes == [0, 0], ts.logs_text(tmp_path / "logs")
    state = read_record(out / "trainer_state.json").data
    assert state["sft"]["steps"] == 5 and state["sft"]["target_reached"] is True
    assert state["optimizer_step"] == 5 and state["world_size"] == 2
    assert ts.optimizer_files(out) == ts.DCP_SHARDS_2
    AutoModelForCausalLM.from_pretrained(str(out))


def test_evals_come_every_eval_every_steps_and_finer_while_the_latest_is_a_quarter_of_the_target():
    from train.sft import eval_due

    opts = {"steps": 100, "eval_every": 25, "eval_every_near": 5, "target_accuracy": 0.4}
    due = [s for s in range(1, 101) if eval_due(s, 0.02, opts)]
    assert due == [25, 50, 75, 100]  # 2% is below a quarter of 40%: the regular interval
    assert [s for s in range(51, 71) if eval_due(s, 0.10, opts)] == [55, 60, 65, 70]  # 10% = a quarter
    assert [s for s in range(1, 30) if eval_due(s, None, opts)] == [25]  # before the first eval
    no_target = dict(opts, target_accuracy=None)
    assert [s for s in range(1, 60) if eval_due(s, 0.9, no_target)] == [25, 50]
