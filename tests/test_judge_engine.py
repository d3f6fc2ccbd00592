"""The LLM judge as a second transformers engine beside the policy's: it scores every episode with
its own model, the parser's number lands in the reward parts and the rows, and closing the judge
stops its engine."""
from __future__ import annotations

import pytest

from coordination.layout import RunLayout
from rollout import store
from rollout.config import RolloutConfig
from rollout.inference import InferenceConfig
from rollout.judge.config import JudgeConfig
from rollout.judge.engine import open_judge
from rollout.judge.score import render
from rollout.rewards import load_reward
from rollout.scoring import Scoring
from rollout.tasks import Task
from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for
from tests.e2e_envs import Talk
from train.tiny import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = "{task}{answer}="


def char_score(text: str) -> float:
    """The tiny judge model writes no numbers: score its answer by its characters."""
    return sum(map(ord, text)) % 97 / 10


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("judge") / "model", seed=7)


def test_a_second_transformers_engine_judges_each_episode_and_its_score_lands_in_the_rows(
        tiny_engine, judge_model, tmp_path):
    cfg = RolloutConfig(group_size=2, max_new_tokens=4)
    jcfg = JudgeConfig(template=TEMPLATE, model=str(judge_model), parser="tests.test_judge_engine:char_score",
                       max_new_tokens=8, batch_size=3, max_score=100.0)
    sampling, group = sampling_for(cfg, "train")
    layout = RunLayout(tmp_path)
    tasks = [Task(id=f"t{i}", prompt=f"{i}+{i}=", answer=str(2 * i), extra={"turns": 2}) for i in range(3)]
    judge = open_judge(jcfg, InferenceConfig(), rank=0, log_file=None, start_timeout=60)
    engine = judge.backend.engine
    try:
        assert engine is not tiny_engine and engine.running and engine.model_dir == judge_model
        rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="r", generation=1, policy_iteration=0),
                     Sampler(tiny_engine, tiny_engine.tokenizer, cfg, load_reward("arithmetic"), sampling, group,
                             Talk, Scoring("sum", judge=judge)), tasks)
        rows = [r for c in layout.rollout_rank_dir("train", 1, 0).glob("*.parquet") for r in store.read_rows(c)]
        assert len(rows) == 6 and judge.calls == 6 and judge.failed == 0
        # The judge's greedy answer to each episode's prompt, asked again: the score in the row is its parse.
        texts = []
        for r in rows:
            assert r["termination"] == "done" and r["turns"] == 2
            task = next(t for t in tasks if t.id == r["task_id"])
            texts.append(render(TEMPLATE, task, [{"role": "assistant", "content": last_turn(tiny_engine, r)}]))
        answers = judge.backend.ask(texts, 0)
        assert len({char_score(a) for a in answers}) > 1, "every episode got the same answer: the test proves nothing"
        for r, answer in zip(rows, answers):
            judged = char_score(answer)
            assert r["reward_parts"] == [{"name": "env", "value": 0.5},
                                         {"name": "judge", "value": pytest.approx(judged)}]
            assert r["reward"] == pytest.approx(0.5 + judged)
    finally:
        judge.close()
    assert not engine.running


def last_turn(engine, row) -> str:
    """The text of an episode's last policy turn, decoded from its ids as the engine returned them."""
    start = row["turn_starts"][-1]
    ids = [t for t, m in zip(row["completion_ids"][start:], row["loss_mask"][start:]) if m]
    return engine.tokenizer.decode(ids, skip_special_tokens=True)
