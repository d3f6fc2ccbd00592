"""Environment episodes' throughput: `python -m rollout.bench --env [--json]` (`python -m bench --what env`).

64 episodes of 5 policy turns of exactly 8 tokens each (EOS does not stop a turn) against an
environment whose every step sleeps 200 ms, on the transformers engine serving the tiny model,
at concurrency 1 and 32: the rank's tasks go to the episode loop (rollout/episodes.py) C at a
time, as the rollout worker hands them over `rollout.prompts_per_call` at a time (group size 1,
so C episodes are in flight). Per concurrency: `wall_s`, `episodes_per_s` and
`generation_busy_s` (the seconds the engine spent inside generate, its own counter).

The bound at concurrency 32 is the slower of the two resources an episode needs: the engine's
work (`generation_busy_s.c1`: the same tokens generated one episode at a time, so batching can
only make it smaller) and the environment's critical path (5 turns x 200 ms x ceil(64 / 32)
waves). Targets: `episodes_per_s.c32 >= 8 x episodes_per_s.c1` and `wall_s.c32 <= 1.3 x
bound_s.c32` (environment waits overlap generation, and the scheduler adds little on top).

The engine gets one torch thread unless told otherwise (`--threads`): on a shared 2-core machine
(load ~9) its OpenMP threads spin-waited for busy cores and one 8-token call of one sequence took
~0.85 s with 2 threads against ~16 ms with 1, which measured the neighbours, not the scheduler.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout.engine import Sampling
from rollout.engines.transformers_engine import TransformersEngine
from rollout.envs import Step
from rollout.episodes import Bounds, EpisodeGroup, run_episodes
from rollout.tasks import Task
from train.tiny import write_tiny_model

SPEEDUP_TARGET = 8.0
BOUND_FACTOR = 1.3


class Sleeper:
    """Each step takes `step_s` seconds (a browser, a remote tool) and asks for another turn
    until the task's `turns`."""

    def __init__(self, task: Any):
        self.turns, self.step_s, self.n = task["turns"], task["step_s"], 0

    def reset(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": "Count on:"}]

    def step(self, text: str) -> Step:
        time.sleep(self.step_s)
        self.n += 1
        return Step([{"role": "user", "content": "more"}], 0.0, self.n >= self.turns)


def _episodes(engine: TransformersEngine, *, episodes: int, turns: int, tokens: int, step_s: float,
              concurrency: int, seed: int) -> dict[str, Any]:
    tasks = [Task(f"e{i}", "", "", extra={"turns": turns, "step_s": step_s}) for i in range(episodes)]
    sampling = Sampling(tokens, temperature=1.0, seed=seed, stop_at_eos=False)
    ended: list[EpisodeGroup] = []
    busy0, calls0 = engine.stats.seconds, engine.stats.requests
    t0 = time.perf_counter()
    for start in range(0, episodes, concurrency):
        # reward_fn is for single-turn tasks: an environment episode's reward is the sum of its steps'.
        run_episodes(engine, engine.tokenizer, tasks[start:start + concurrency], 1, sampling, reward_fn=None,
                     env_factory=Sleeper, bounds=Bounds(turns, 4 * turns * (tokens + 16) + 64, 30.0),
                     on_group=ended.append)
    wall = time.perf_counter() - t0
    eps = [e for g in ended for e in g.episodes]
    wrong = [(e.task.id, e.termination, e.turns, e.error) for e in eps
             if (e.termination, e.turns, sum(e.loss_mask)) != ("done", turns, turns * tokens)]
    if len(eps) != episodes or wrong:
        raise RuntimeError(f"the benchmark's episodes did not run as set up ({len(eps)} of {episodes} ended; "
                           f"first wrong: {wrong[:3]}); the episode loop is broken")
    return {"wall_s": wall, "generation_busy_s": engine.stats.seconds - busy0,
            "engine_calls": engine.stats.requests - calls0, "episodes_per_s": episodes / wall}


def run_env_bench(model_dir: Path | None = None, *, episodes: int = 64, turns: int = 5, tokens: int = 8,
                  step_s: float = 0.2, concurrency: tuple[int, int] = (1, 32), threads: int = 1,
                  seed: int = 0) -> dict[str, Any]:
    low, high = concurrency
    with tempfile.TemporaryDirectory(prefix="baton-bench-env-") as tmp:
        model_dir = model_dir or write_tiny_model(Path(tmp) / "tiny")
        with TransformersEngine(threads=threads) as engine:
            engine.start(model_dir)
            engine.generate([[1, 5, 6]], 2, Sampling(2, seed=0))  # warm-up
            load_before = os.getloadavg()[0]
            runs = {f"c{c}": _episodes(engine, episodes=episodes, turns=turns, tokens=tokens, step_s=step_s,
                                       concurrency=c, seed=seed) for c in (low, high)}
    lo, hi = f"c{low}", f"c{high}"
    env_path = turns * step_s * math.ceil(episodes / high)
    bound = max(runs[lo]["generation_busy_s"], env_path)
    out: dict[str, Any] = {key: {c: r[key] for c, r in runs.items()}
                           for key in ("episodes_per_s", "wall_s", "generation_busy_s", "engine_calls")}
    speedup = runs[hi]["episodes_per_s"] / runs[lo]["episodes_per_s"]
    out.update({
        "bound_s": {hi: bound, "env_critical_path_s": env_path},
        "speedup": speedup,
        "wall_over_bound": runs[hi]["wall_s"] / bound,
        "targets": {f"episodes_per_s.{hi} >= {SPEEDUP_TARGET:g} x {lo}": speedup >= SPEEDUP_TARGET,
                    f"wall_s.{hi} <= {BOUND_FACTOR:g} x bound_s.{hi}": runs[hi]["wall_s"] <= BOUND_FACTOR * bound},
        "setup": {"episodes": episodes, "turns": turns, "tokens_per_turn": tokens, "env_step_s": step_s,
                  "threads": threads, "load_average": [load_before, os.getloadavg()[0]]},
    })
    out["targets_met"] = all(out["targets"].values())
    return out
