"""The environment-episode benchmark measures what it says: every episode runs its turns of
exactly its tokens, the engine is called once per turn at concurrency 1, batched above it, and
the bound and targets follow the formula (small sizes here; the real sizes are the command's)."""
from __future__ import annotations

import math

import pytest

from bench.env_speed import run_env_bench

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_env_benchmark_reports_each_concurrency_and_its_bound():
    episodes, turns, tokens, step_s = 6, 2, 3, 0.1
    r = run_env_bench(episodes=episodes, turns=turns, tokens=tokens, step_s=step_s, concurrency=(1, 4))
    assert r["engine_calls"]["c1"] == episodes * turns  # one episode in flight: one call per turn
    assert r["engine_calls"]["c4"] >= math.ceil(episodes / 4) * turns  # at best one call per wave and turn
    for c in ("c1", "c4"):
        assert r["episodes_per_s"][c] == pytest.approx(episodes / r["wall_s"][c])
        assert 0 < r["generation_busy_s"][c] < r["wall_s"][c]
    # At concurrency 1 nothing overlaps: the wall holds every step's sleep and every generation.
    assert r["wall_s"]["c1"] >= episodes * turns * step_s + r["generation_busy_s"]["c1"]
    env_path = turns * step_s * math.ceil(episodes / 4)
    assert r["bound_s"] == {"c4": max(r["generation_busy_s"]["c1"], env_path), "env_critical_path_s": env_path}
    assert r["targets"] == {"episodes_per_s.c4 >= 8 x c1": r["speedup"] >= 8,
                            "wall_s.c4 <= 1.3 x bound_s.c4": r["wall_s"]["c4"] <= 1.3 * r["bound_s"]["c4"]}
    assert r["targets_met"] == all(r["targets"].values())

