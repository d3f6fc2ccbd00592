"""A real run of scripts/run.sh with an LLM judge served by a second transformers engine: the
driver opens the judge for the rollout phase and closes it at the phase's end, and every training
row carries the judge's score as its 'judge' reward part."""
from __future__ import annotations

import pytest

from coordination.layout import RunLayout
from coordination.records import read_record
from tests.e2e import fresh_log, node_cmd, rows
from tests.test_judge_engine import TEMPLATE

pytestmark = pytest.mark.slow


def test_the_driver_judges_the_rollout_phase_with_a_second_engine_it_starts_and_stops(
        procs, tmp_path, assets):
    data, model = assets
    log = fresh_log(tmp_path)
    procs.start("n0", node_cmd(data, model, log, "--rl-phase", "both", "--eval-interval", "0",
                               overrides=("run.max_iterations=1", f"tasks.judge.template='{TEMPLATE}'",
                                          f"tasks.judge.model={model}", "tasks.judge.max_new_tokens=4",
                                          "tasks.judge.max_score=100",
                                          "tasks.judge.parser=tests.test_judge_engine:char_score")))
    assert procs.wait_all(400) == {"n0": 0}, procs.log("n0")[-3000:]
    lay = RunLayout(log)
    table = rows(lay, 1)
    assert table.num_rows == 24 * 4
    for r in table.to_pylist():
        names = [p["name"] for p in r["reward_parts"]]
        assert names == ["reward", "judge"] and r["termination"] == "done"
        assert r["reward"] == pytest.approx(sum(p["value"] for p in r["reward_parts"]), abs=1e-5)
    driver = lay.job("both").log_file(0, "driver").read_text()
    started = driver.index("judge engine transformers serves")
    stopped = driver.index("judge engine transformers stopped")
    assert started < stopped < driver.index("judge closed: 96 answers asked for, 0 episodes without a score")
    assert read_record(lay.latest).data["iteration"] == 1
