"""The `web` environment against its real local HTTP server (`python -m rollout.envs.web_site`,
started as a child in its own process group): an agent that follows links finds every fact, the
bounds on each request, and a server killed in the middle of a rank's rollout (its episodes end
as env_error with the reason, the rank goes on and publishes DONE, counts exact)."""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from coordination.layout import RunLayout
from coordination.procgroup import start_child
from rollout import store
from rollout.chunks import read_done
from rollout.config import RolloutConfig
from rollout.envs import EnvError, check_env, load_env
from rollout.envs.web import HOW, Web, WebError
from rollout.rewards import load_reward
from rollout.tasks import load_tasks
from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for

ROOT = Path(__file__).resolve().parent.parent


class Site:
    def __init__(self, out: Path):
        self.out = out
        self.child = start_child([sys.executable, "-m", "rollout.envs.web_site", "--out", out, "--sections", "2",
                                  "--items", "4"], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                 log_file=out / "server.log", what="web site")
        deadline = time.monotonic() + 30
        while not (out / "server.json").exists():
            if self.child.poll() is not None or time.monotonic() > deadline:
                self.child.stop()
                raise AssertionError(f"the site server wrote no server.json within 30 s (exit "
                                     f"{self.child.poll()}):\n{(out / 'server.log').read_text()}")
            time.sleep(0.05)
        self.url = json.loads((out / "server.json").read_text())["url"]
        self.tasks, self.eval = load_tasks(out / "train.jsonl"), load_tasks(out / "eval.jsonl")

    def kill(self) -> None:
        self.child.stop(timeout=5)
        assert self.child.returncode is not None


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path / "site")
    try:
        yield s
    finally:
        s.kill()


def solve(env: Web, task) -> float:
    """Open sections until the item's link shows, open it, answer its code: the reward."""
    item = re.fullmatch(r"What is the code of (.+)\?", task.prompt).group(1)
    page = env.reset()[0]["content"]
    sections = len(re.findall(r"^\[\d+\] ", page, re.M))
    for k in range(1, sections + 1):
        page = env.step(f"open {k}").messages[0]["content"]
        if f"] {item}\n" in page + "\n":
            page = env.step(f"I will look.\nopen {item}").messages[0]["content"]  # by the link's text
            code = re.search(rf"The code of {item} is (\d+)\.", page).group(1)
            step = env.step(f"answer {code}.")
            assert step.done and step.messages == []
            return step.reward
        env.step("open Directory")
    raise AssertionError(f"{item} is linked from no section:\n{page}")


def test_an_agent_that_follows_links_finds_every_fact_and_only_the_right_answer_is_rewarded(site):
    assert load_env("web") is Web
    assert [len(site.tasks), len(site.eval)] == [6, 2]  # every fourth fact is an eval task
    for task in site.tasks + site.eval:
        assert task["url"] == f"{site.url}/index.html"
        assert solve(Web(task), task) == 1.0
    env = Web(site.tasks[0])
    env.reset()
    assert env.step("answer 12345").reward == 0.0


def test_the_observation_is_the_page_text_with_numbered_links_and_only_those_links_open(site):
    env = Web(site.tasks[0])
    first = env.reset()[0]["content"]
    assert first.startswith(f"{site.tasks[0].prompt}\nAct with `open <link number>`")
    assert f"Page: {site.url}/index.html\nDirectory\nEvery section of the directory.\nLinks:\n[1] " in first
    assert len(re.findall(r"^\[\d\] ", first, re.M)) == 2
    step = env.step("open 3")
    assert not step.done and step.messages[0]["content"].startswith("No link '3' on this page (links: [1] ")
    assert env.step("no action here").messages[0]["content"].startswith("No action found.")
    section = env.step("open [1]").messages[0]["content"]
    assert section.startswith(f"Page: {site.url}/s0/index.html\n") and section.endswith("\n[5] Directory")
    (site.out / "site" / "trap.html").write_text('<a href="file:///etc/hostname">secrets</a> <a href="s1/">on</a>')
    trap = Web({"id": "t", "prompt": "?", "answer": "1", "url": f"{site.url}/trap.html"})
    assert trap.reset()[0]["content"].endswith("\nLinks:\n[1] on")  # no link to this node's files
    assert trap.step("open secrets").messages[0]["content"].startswith("No link 'secrets' on this page (links: [1] on)")
    lost = Web({"id": "t", "prompt": "?", "answer": "1", "url": f"{site.url}/nowhere.html"})
    # A status page is what a browser shows: an observation, not an environment error.
    assert lost.reset()[0]["content"].startswith(f"?\n{HOW}\n\nPage: {site.url}/nowhere.html\nHTTP status 404\n")


def test_a_page_is_read_up_to_max_page_bytes_and_says_where_it_was_cut(site):
    task = site.tasks[0]
    short = Web(type(task)(task.id, task.prompt, task.answer, extra={**task.extra, "max_page_bytes": 120}))
    page = short.reset()[0]["content"]
    assert page.endswith("[page cut at 120 bytes]\nLinks: none")
    whole = (site.out / "site" / "index.html").read_text()
    first_section = re.search(r'<a href="s0/index.html">([^<]+)</a>', whole)
    assert first_section.start() > 120  # the links lie past the cut: none is read, none can be opened
    assert "Every section of the directory." in page and first_section.group(1) not in page and short.links == []


def test_a_server_that_never_answers_raises_within_the_http_timeout():
    with socket.socket() as listener:  # accepts connections (the kernel's backlog), never replies
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        env = Web({"id": "t", "prompt": "?", "answer": "1", "url": f"http://127.0.0.1:{port}/", "http_timeout": 0.5})
        t0 = time.monotonic()
        with pytest.raises(WebError, match=rf"cannot fetch http://127.0.0.1:{port}/: timed out "
                                           r"\(http_timeout=0.5 s\); is the site's server running"):
            env.reset()
        assert 0.4 < time.monotonic() - t0 < 3


@pytest.mark.parametrize("extra, says", [
    ({}, "url=None is not an http(s) URL; give the start page's full address as the task's 'url'"),
    ({"url": "file:///etc/passwd"}, "url='file:///etc/passwd' is not an http(s) URL"),
    ({"url": "http://h/", "http_timeout": 0}, "http_timeout=0 must be a positive number (default 10)"),
    ({"url": "http://h/", "max_page_bytes": "lots"}, "max_page_bytes='lots' must be a positive number"),
])
def test_a_task_the_environment_cannot_use_is_refused_naming_the_field(extra, says):
    with pytest.raises(ValueError, match=re.escape(f"task 't': {says}")):
        Web({"id": "t", "prompt": "?", "answer": "1", **extra})


def test_a_killed_server_ends_the_next_open_as_a_web_error_and_a_run_cannot_start_without_it(site):
    env = Web(site.tasks[0])
    env.reset()
    assert check_env("web", site.tasks[0], timeout=10.0) is Web  # the start check's reset() with the server up
    site.kill()
    with pytest.raises(WebError, match=rf"cannot fetch {re.escape(site.url)}/s0/index.html: .*Connection refused"):
        env.step("open 1")
    with pytest.raises(EnvError, match=rf"tasks.env='web' raised WebError: cannot fetch {re.escape(site.url)}"
                                       r"/index.html: .*Connection refused.* when built and reset on task 'web-0'"):
        check_env("web", site.tasks[0], timeout=10.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny model with room for a page in its prompt (the shared fixture's has 256 positions)."""
    from rollout.engines.transformers_engine import TransformersEngine
    from train.tiny import write_tiny_model

    eng = TransformersEngine(threads=1)
    eng.start(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", max_positions=1024))
    yield eng
    eng.stop()


def test_a_server_killed_mid_rollout_ends_the_later_episodes_as_env_error_and_the_rank_goes_on(site, engine,
                                                                                                 tmp_path):
    layout = RunLayout(tmp_path / "run")
    cfg = RolloutConfig(group_size=2, max_new_tokens=8, prompts_per_call=2, max_turns=2, max_episode_tokens=1000,
                        env_step_timeout=10.0, max_env_error_rate=1.0)
    sampling, group = sampling_for(cfg, "train")
    killed_after = []

    def progress(done, total, message):
        if done == 2 and not killed_after:  # the first engine call's two tasks are written
            site.kill()
            killed_after.append(done)

    summary = rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="r", generation=1, policy_iteration=0),
                           Sampler(engine, engine.tokenizer, cfg, load_reward("arithmetic"), sampling, group, Web),
                           site.tasks, on_progress=progress)
    assert killed_after == [2] and summary.samples == 12
    manifest, _ = read_done(layout.rollout_done("train", 1, 0), run_id="r")
    assert sorted(t for c in manifest.chunks for t in c["task_ids"]) == sorted(t.id for t in site.tasks)
    chunks = sorted(layout.rollout_rank_dir("train", 1, 0).glob("*.parquet"))
    rows = {(r["task_id"], r["sample_index"]): r for c in chunks for r in store.read_rows(c)}
    assert len(rows) == 12
    before = {t.id for t in site.tasks[:2]}
    for (task_id, _), r in rows.items():
        if task_id in before:
            # The random policy's turns are no actions: each was answered with the page's help text.
            assert (r["termination"], r["error"], r["turns"]) == ("max_turns", None, 2)
            assert f"Page: {site.url}/index.html" in engine.tokenizer.decode(r["prompt_ids"])
        else:
            assert (r["termination"], r["turns"], r["reward"], r["completion_ids"]) == ("env_error", 0, 0.0, [])
            assert re.fullmatch(rf"the factory or reset\(\) raised WebError: cannot fetch {re.escape(site.url)}"
                                r"/index.html: .*Connection refused.*", r["error"])
    assert sum(r["termination"] == "env_error" for r in rows.values()) == 8
