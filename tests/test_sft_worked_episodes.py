"""Worked episodes: the calculator's own solution played against it, and SFT examples of several
assistant turns laid out token for token as the episodes rollouts sample (loss on those turns only)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rollout.engine import Engine, Sample, Sampling
from rollout.envs import load_env
from rollout.envs.calculator import worked_turn
from rollout.envs.worked import play
from rollout.episodes import Bounds, run_episodes
from rollout.tasks import calculator_tasks, write_tasks
from tests.procs import ROOT, env
from train.sft_data import SFTDataError, load_examples
from train.tiny import build_tokenizer

PY = str(ROOT / ".venv" / "bin" / "python")


class Scripted(Engine):
    """Samples the given texts, one per call, as the token ids the tokenizer gives them (+ EOS)."""

    name = "scripted"

    def __init__(self, tokenizer, texts: list[str]):
        super().__init__()
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    def start(self, model_dir: Path) -> None: ...

    def stop(self) -> None: ...

    def reload(self, model_dir: Path) -> None: ...

    def generate(self, prompts, n, sampling):
        self.prompts.append(prompts[0])
        text = self.texts.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [[Sample(ids, [-0.5] * len(ids), text, "stop")]]


def test_a_worked_episode_becomes_the_token_sequence_an_episode_of_the_same_turns_has(tmp_path):
    tok = build_tokenizer()
    task = calculator_tasks(1, 0, digits=3, seed=4)[0][0]
    messages = play(load_env("calculator"), worked_turn, task, max_turns=3, success=1.0)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["content"] == f"<calc>{task['expression']}</calc>" and messages[3]["content"] == task.answer
    path = tmp_path / "worked.jsonl"
    path.write_text(json.dumps({"id": task.id, "messages": messages}) + "\n")
    (example,) = load_examples(path, tok)

    engine = Scripted(tok, [messages[1]["content"], messages[3]["content"]])
    groups = []
    run_episodes(engine, tok, [task], 1, Sampling(24), reward_fn=None, env_factory=load_env("calculator"),
                 bounds=Bounds(3, 256, 10.0), on_group=groups.append)
    (episode,) = groups[0].episodes
    assert episode.reward == 1.0 and episode.turns == 2
    assert example.prompt_ids == episode.prompt_ids
    assert example.completion_ids == episode.ids and example.loss_mask == episode.loss_mask
    tool_reply = tok(f"tool: {task.answer}\nassistant: ", add_special_tokens=False)["input_ids"]
    assert example.trained_tokens == len(example.completion_ids) - len(tool_reply)


def test_a_worked_episode_that_does_not_solve_its_task_is_refused():
    task = calculator_tasks(1, 0, digits=3, seed=4)[0][0]
    with pytest.raises(ValueError, match=rf"reward 0 on task '{task.id}', below --success 1"):
        play(load_env("calculator"), lambda t, m: "12", task, max_turns=3, success=1.0)
    with pytest.raises(ValueError, match=r"did not finish task .* within 1 turns"):
        play(load_env("calculator"), worked_turn, task, max_turns=1, success=1.0)


def test_chat_examples_must_end_with_the_assistant(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "1*2?"},
                                             {"role": "assistant", "content": "<calc>1*2</calc>"},
                                             {"role": "tool", "content": "2"}]}) + "\n")
    with pytest.raises(SFTDataError, match=r"bad.jsonl:1: the last message must be the assistant's reply"):
        load_examples(path, build_tokenizer())


def test_the_worked_command_writes_episodes_and_names_a_missing_solver(tmp_path):
    train, _ = calculator_tasks(5, 0, digits=2, seed=1)
    write_tasks(tmp_path / "train.jsonl", train)
    run = [PY, "-P", "-m", "rollout.envs.worked", "--tasks", str(tmp_path / "train.jsonl"),
           "--out", str(tmp_path / "w.jsonl"), "--count", "3"]
    done = subprocess.run(run + ["--env", "calculator"], env=env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == [t.id for t in train[:3]]
    done = subprocess.run(run + ["--env", "guess"], env=env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--env guess has no built-in solver" in done.stderr


def test_the_demo_refuses_an_unknown_demo_name_listing_the_choices(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env(BATON_DEMO="agents",
                          BATON_DEMO_DIR=str(tmp_path / "d")), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "BATON_DEMO must be one of: arithmetic (the default), agent (got 'agents')" in done.stderr
    assert not (tmp_path / "d").exists()
