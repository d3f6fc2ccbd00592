"""A real run of scripts/run.sh on guess episodes: the driver rolls out multi-turn episodes with
the environment that tasks.env names, aggregates their stats and trains on their policy tokens."""
from __future__ import annotations

import pyarrow.compute as pc

from coordination.layout import RunLayout
from coordination.records import read_record
from rollout.tasks import Task, write_tasks
from tests.e2e import fresh_log, node_cmd, rows


def test_one_node_trains_on_guess_episodes(procs, tmp_path, assets):
    _, model = assets
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 48), ("eval", 8)):
        write_tasks(data / f"{split}.jsonl", [Task(f"{split}-{i}", "guess", str(1 + i % 9), extra={"low": 1, "high": 9})
                                              for i in range(n)])
    log = fresh_log(tmp_path)
    procs.start("n0", node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "0",
                               overrides=("run.max_iterations=1", "tasks.env=guess", "rollout.max_turns=3",
                                          "rollout.max_new_tokens=3",
                                          "rollout.max_episode_tokens=256")))
    assert procs.wait_all(400) == {"n0": 0}, procs.log("n0")[-3000:]
    lay = RunLayout(log)
    table = rows(lay, 1)
    assert table.num_rows == 24 * 4
    turns = table["turns"].to_pylist()
    assert min(turns) >= 1 and max(turns) <= 3 and max(turns) > 1
    assert set(table["termination"].to_pylist()) <= {"done", "max_turns", "max_tokens"}
    masks, ids = table["loss_mask"].to_pylist(), table["completion_ids"].to_pylist()
    assert all(len(m) == len(i) for m, i in zip(masks, ids)) and any(0 in m for m in masks)
    stats = read_record(lay.rollout_stats("train", 1)).data
    assert stats["episodes"]["turns_mean"] == sum(turns) / len(turns)
    assert sum(stats["episodes"]["terminations"].values()) == 24 * 4
    plan = read_record(lay.training_plan(1)).data
    kept = int(pc.sum(pc.list_flatten(table["loss_mask"])).as_py())
    assert 0 < sum(s["completion_tokens"] for s in plan["steps"]) <= kept
    assert read_record(lay.latest).data["iteration"] == 1
