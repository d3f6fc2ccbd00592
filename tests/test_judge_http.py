"""The LLM judge behind an OpenAI-compatible URL, served by a real HTTP server in the test: its
scores land in the episodes' reward parts and rows, its key comes from env:NAME, and a judge that
answers 500s, garbage or nothing within its timeout is tried `attempts` times, then ends the
episode as judge_error, counted against rollout.max_env_error_rate and quoted when it fails."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from coordination.layout import RunLayout
from rollout import store
from rollout.chunks import RolloutError
from rollout.config import RolloutConfig
from rollout.inference import InferenceConfig
from rollout.judge.config import JudgeConfig
from rollout.judge.engine import open_judge
from rollout.judge.score import render
from rollout.rewards import load_reward
from rollout.scoring import Scoring
from rollout.tasks import Task
from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = "Task: {task}\nEpisode:\n{trajectory}\nAnswer: {answer}\nScore it."
KEY = "sk-judge-test-0123"


def score_of(prompt: str) -> float:
    """What the test's judge answers for a prompt: a function of all of it, so a score proves which
    prompt it was asked."""
    return (len(prompt) % 7) / 4  # 0 .. 1.5: above 1.0 proves the bound to max_score


class Server:
    """A chat-completions endpoint whose behaviour a test sets: ok, 500, garbage, hang, or
    500 on the first try of each prompt and ok after."""

    def __init__(self):
        self.mode, self.requests, self.release = "ok", [], threading.Event()
        self.seen: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"]
                outer.requests.append((self.path, self.headers.get("Authorization"), body))
                tries = outer.seen[prompt] = outer.seen.get(prompt, 0) + 1
                mode = outer.mode
                if mode == "flaky":
                    mode = "500" if tries == 1 else "ok"
                if mode == "hang":
                    outer.release.wait(10)
                    return
                if mode == "500":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"overloaded")
                    return
                text = f"The episode deserves {score_of(prompt)}" if mode == "ok" else "I would rather not say."
                out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(out.encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("BATON_TEST_JUDGE_KEY", KEY)
    s = Server()
    yield s
    s.close()


def tasks(n):
    return [Task(id=f"t{i}", prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(n)]


def roll(engine, layout, judge_cfg, max_rate=0.1):
    cfg = RolloutConfig(group_size=2, max_new_tokens=4, max_env_error_rate=max_rate)
    sampling, group = sampling_for(cfg, "train")
    judge = open_judge(judge_cfg, InferenceConfig(), rank=0, log_file=None, start_timeout=60)
    try:
        rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="r", generation=1, policy_iteration=0),
                     Sampler(engine, engine.tokenizer, cfg, load_reward("arithmetic"), sampling, group, None,
                             Scoring(judge=judge)), tasks(3))
    finally:
        judge.close()
    return [r for c in sorted(layout.rollout_rank_dir("train", 1, 0).glob("*.parquet")) for r in store.read_rows(c)]


def judge_cfg(server, **kw):
    return JudgeConfig(template=TEMPLATE, model="judge-model", url=server.url, api_key="env:BATON_TEST_JUDGE_KEY",
                       **kw)


def test_judge_scores_land_in_reward_parts_and_rows_bounded_to_the_range(tiny_engine, server, tmp_path, caplog):
    rows = roll(tiny_engine, RunLayout(tmp_path), judge_cfg(server, batch_size=4))
    assert len(rows) == 6 and len(server.requests) == 6
    for path, auth, body in server.requests:
        assert (path, auth, body["model"], body["max_tokens"]) == ("/v1/chat/completions", f"Bearer {KEY}",
                                                                   "judge-model", 64)
    for r in rows:
        task = Task(id=r["task_id"], prompt=r["prompt"], answer="")
        messages = [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["text"]}]
        judged = min(1.0, score_of(render(TEMPLATE, task, messages)))
        assert r["termination"] == "done"
        assert r["reward_parts"] == [{"name": "reward", "value": pytest.approx(r["reward"] - judged)},
                                     {"name": "judge", "value": pytest.approx(judged)}]
    assert KEY not in caplog.text


def test_a_flaky_judge_is_tried_again_and_scores(tiny_engine, server, tmp_path):
    server.mode = "flaky"
    rows = roll(tiny_engine, RunLayout(tmp_path), judge_cfg(server, attempts=2))
    assert {r["termination"] for r in rows} == {"done"}
    assert len(server.requests) == 12 and set(server.seen.values()) == {2}


@pytest.mark.parametrize("mode, says", [
    ("500", "HTTP 500 from {url}/chat/completions: overloaded"),
    ("garbage", "answer 'I would rather not say.': ValueError: the answer holds no number"),
    ("hang", "{url}/chat/completions gave no answer within tasks.judge.timeout=0.5 s"),
])
def test_a_failing_judge_is_counted_quoted_and_bounded(tiny_engine, server, tmp_path, mode, says):
    server.mode = mode
    says = says.format(url=server.url)
    cfg = judge_cfg(server, attempts=2, timeout=0.5)
    with pytest.raises(RolloutError, match=r"6 of 6 episodes ended with an environment error, timeout or judge error"
                                           r".*task t\d episode \d \(judge_error\): the judge gave no score in 2 "
                                           r"tries \(tasks.judge.attempts\); last: ") as failed:
        roll(tiny_engine, RunLayout(tmp_path / "strict"), cfg)
    assert says in str(failed.value)
    assert len(server.requests) == 12  # 6 episodes x 2 tries, no more
    rows = roll(tiny_engine, RunLayout(tmp_path / "lenient"), cfg, max_rate=1.0)
    assert [(r["termination"], r["reward"], r["reward_parts"]) for r in rows] == [("judge_error", 0.0, [])] * 6
    assert all(says in r["error"] for r in rows)
