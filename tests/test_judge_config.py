"""The judge's settings: a bad template, URL or key is refused naming the value and the fix (at
config load, or by the start check judge-ready), and a vLLM judge on the GPUs counts in the
rollout phase's memory."""
from __future__ import annotations

import re
import subprocess
from types import SimpleNamespace

import pytest

from coordination.config import ConfigError
from rl.validate.run import judge_ready
from rollout.config import TasksConfig
from rollout.inference import InferenceConfig
from rollout.judge.config import JudgeConfig
from tests.procs import ROOT, env
from tests.test_memory_plan import _cfg, _dry_run, _model
from train.memory_check import check_memory
from train.memory_plan import format_plan

KEY = "sk-judge-test-0123"
GIB = 2 ** 30


def test_judge_settings_are_refused_naming_the_value_and_the_fix(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"judge.template names \{score\}, which is not a field; the fields are "
                                          r"\{task\}, \{trajectory\}, \{answer\}"):
        JudgeConfig(template="{score}", model="m")
    with pytest.raises(ConfigError, match="not a valid template"):
        JudgeConfig(template="{answer", model="m")
    with pytest.raises(ConfigError, match="judge.url='ftp://x' is not an http"):
        JudgeConfig(template="{answer}", model="m", url="ftp://x")
    with pytest.raises(ConfigError, match="judge.api_key must be env:NAME or file:PATH, not the key itself") as e:
        JudgeConfig(template="{answer}", model="m", url="http://h/v1", api_key=KEY)
    assert KEY not in str(e.value)
    monkeypatch.delenv("BATON_TEST_JUDGE_MISSING", raising=False)

    def rule(**judge):
        cfg = SimpleNamespace(tasks=TasksConfig(judge=JudgeConfig(template="{answer}", **judge)),
                              inference=InferenceConfig())
        return judge_ready(SimpleNamespace(cfg=cfg, splits=["train"]))

    assert rule(model="m", url="http://h/v1", api_key="env:BATON_TEST_JUDGE_MISSING") == (
        "tasks.judge.api_key=env:BATON_TEST_JUDGE_MISSING: environment variable BATON_TEST_JUDGE_MISSING is not set "
        "(or empty) on this node; export it before scripts/run.sh")
    assert rule(model=str(tmp_path / "none")).startswith(f"tasks.judge.model={tmp_path / 'none'} is not a folder")
    assert "cannot import module 'no_such_parser'" in rule(model="m", url="http://h/v1", parser="no_such_parser:f")
    (tmp_path / "judge").mkdir()
    assert rule(model=str(tmp_path / "judge")) is None


def test_a_vllm_judge_on_the_gpus_counts_in_the_rollout_phase_memory(tmp_path):
    model = _model(tmp_path)
    judge = ["tasks.judge.template=rate {answer}", f"tasks.judge.model={model}", "tasks.judge.engine=vllm"]
    # The gpu example rolls out with 0.85 x 80 GiB for the policy's server and 1.5 GiB the trainer keeps.
    plan = check_memory(_cfg(model, *judge, "tasks.judge.gpu_memory_utilization=0.1"), serves=True, trains=True,
                        num_nodes=2)
    assert plan.judge == pytest.approx(0.1 * 80 * GIB)
    assert plan.rollout_total == pytest.approx((0.85 * 80 + 0.1 * 80 + 1.5) * GIB)
    table = format_plan(plan)   # what the dry run prints: the judge's row and the phase's sum
    assert re.search(r"judge's vLLM server, rollout only.* 8\.00\n", table)
    assert re.search(r"while rolling out \(engine \+ judge \+ trainer\) of 80\.0 GiB: fits +77\.50\n", table)
    with pytest.raises(ConfigError, match=r"while rolling out, the vLLM server \(68.0 GiB = gpu_memory_utilization "
                                          r"0.85 x 80.0 GiB.*\), the judge's vLLM server \(16.0 GiB = tasks.judge."
                                          r"gpu_memory_utilization 0.2 x 80.0 GiB\) and the trainer \(1.5 GiB: .*\) "
                                          r"need 85.5 GiB .*settings that fit: tasks.judge.gpu_memory_utilization="
                                          r"0.13 or less; the judge behind tasks.judge.url"):
        check_memory(_cfg(model, *judge, "tasks.judge.gpu_memory_utilization=0.2"), serves=True, trains=True,
                     num_nodes=2)
    assert check_memory(_cfg(model, *judge[:2], "tasks.judge.gpu_memory_utilization=0.2"), serves=True, trains=True,
                        num_nodes=2) is not None  # a transformers judge: not the vLLM share


@pytest.mark.parametrize("override, message", [
    ("tasks.env_reward=max", "tasks.env_reward='max' is not one of sum, last, none"),
    ("tasks.judge.template=rate {score}", "judge.template names {score}, which is not a field"),
    ("tasks.judge.api_key=sk-literal", "judge.api_key must be env:NAME or file:PATH, not the key itself"),
])
def test_a_bad_reward_or_judge_setting_stops_the_command_with_exit_2(tmp_path, override, message):
    res = subprocess.run([str(ROOT / "scripts" / "run.sh"), "--data-path", str(tmp_path), "--log-path",
                          str(tmp_path / "l"), "--rl-phase", "update", override], env=env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert "sk-literal" not in res.stderr + res.stdout
    assert not (tmp_path / "l").exists()


def test_a_dry_run_with_a_judge_key_that_is_not_there_exits_2_naming_it_and_writes_nothing(tmp_path):
    res = _dry_run(tmp_path, "tasks.judge.template=rate {answer}", "tasks.judge.url=http://127.0.0.1:9/v1",
                   "tasks.judge.model=judge", "tasks.judge.api_key=env:BATON_TEST_JUDGE_NOT_SET")
    assert res.returncode == 2, res.stdout + res.stderr
    assert ("tasks.judge.api_key=env:BATON_TEST_JUDGE_NOT_SET: environment variable BATON_TEST_JUDGE_NOT_SET is not "
            "set (or empty) on this node; export it before scripts/run.sh") in " ".join(res.stderr.split())
    assert not (tmp_path / "run").exists()
