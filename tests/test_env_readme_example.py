"""The README's own-environment example is real code that works: loaded from README.md as the
user would save it, it scores a walk through the ladder, and the rollout runs episodes with it
on the tiny model's transformers engine."""
from __future__ import annotations

import re
import sys

import pytest

from rollout.engine import Sampling
from rollout.envs import load_env
from rollout.episodes import Bounds
from rollout.rewards import load_reward
from rollout.tasks import Task
from rollout.worker import roll_groups
from tests.procs import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def ladder(tmp_path, monkeypatch):
    """The README's example saved as mypackage/ladder.py, importable as the README says."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
              if "def step(self, text)" in b]
    assert len(blocks) == 1, "README.md should hold exactly one example environment"
    lines = blocks[0].count("\n")
    assert lines <= 30, f"the README promises an environment in 30 lines; its example has {lines}"
    spec = re.search(r"tasks\.env=([\w.]+:\w+)", (ROOT / "README.md").read_text()).group(1)
    module = spec.split(":")[0]
    path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True)
    path.write_text(blocks[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    yield load_env(spec)
    for name in [m for m in sys.modules if m == module or module.startswith(m + ".")]:
        del sys.modules[name]


def task():
    return Task("w1", "warm to cold", "cold", extra={"start": "warm"})


def test_the_readme_example_scores_a_walk_down_the_ladder(ladder):
    env = ladder(task())
    assert env.reset() == [{"role": "user", "content": "Change one letter at a time: warm -> cold."}]
    moved = env.step("worm ward")  # "worm" is one letter from "warm": taken; the rest is ignored
    assert (moved.messages, moved.reward, moved.done) == ([{"role": "user", "content": "Now at worm."}], None, False)
    assert env.step("cold").messages == [{"role": "user", "content": "'cold' is not one letter from worm."}]
    for word in ("word", "cord"):
        assert not env.step(word).done
    end = env.step("cold")
    assert (end.messages, end.reward, end.done) == ([], 0.25, True)  # 4 moves: reward 1 / 4


def test_the_rollout_runs_episodes_with_the_readme_example(ladder, tiny_engine):
    groups = roll_groups(tiny_engine, tiny_engine.tokenizer, [task()], 3, Sampling(max_new_tokens=6, seed=3),
                         load_reward("arithmetic"), env_factory=ladder, bounds=Bounds(3, 200, 10.0))
    episodes = groups[0].episodes
    assert len(episodes) == 3
    for e in episodes:
        # The random policy's words are no ladder steps: three refused turns, then max_turns.
        assert (e.termination, e.turns, e.reward, e.error) == ("max_turns", 3, 0.0, "")
        assert tiny_engine.tokenizer.decode(e.prompt_ids, skip_special_tokens=True) == \
            "user: Change one letter at a time: warm -> cold.\nassistant: "
        assert e.text.count("is not one letter from warm.") == 2
