"""Secrets are read from the environment or a file and never echoed; entrypoints never import
from the current folder; the bench leaves a user's folder's mode alone (issue 13 defect 10)."""
from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coordination.config import ConfigError, redact, redact_argv
from coordination.layout import RunLayout
from rollout.engines.vllm_server import build_server
from rl.runconfig import load_run_config
from rollout.inference import VLLMConfig
from rollout.tasks import arithmetic_tasks, write_tasks
from tests.e2e import RUN_SH, weightless_model
from tests.procs import ROOT, env

SECRET = "sekrit-4f9a1c77e2"


def _build(cfg: VLLMConfig):
    return build_server(cfg, Path("/models/m"), port=8000, rank=0, restart_count=0, temperature=1.0, dtype="auto",
                        between_iterations="restart", cache_root=None)


def test_api_key_is_read_from_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_TEST_KEY", SECRET)
    spec = _build(VLLMConfig(host="10.1.2.3", api_key="env:BATON_TEST_KEY"))
    assert spec.api_key == SECRET and spec.env["VLLM_API_KEY"] == SECRET and SECRET not in " ".join(spec.argv)
    key_file = tmp_path / "key"
    key_file.write_text(SECRET + "\n")
    assert _build(VLLMConfig(host="10.1.2.3", api_key=f"file:{key_file}")).api_key == SECRET


def test_a_missing_key_source_is_named_without_the_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("BATON_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="environment variable BATON_TEST_KEY is not set"):
        VLLMConfig(api_key="env:BATON_TEST_KEY").resolved_api_key()
    with pytest.raises(ConfigError, match="cannot read it"):
        VLLMConfig(api_key=f"file:{tmp_path / 'nope'}").resolved_api_key()
    for bad in ("env:", "env:1X", "file:", "***"):
        with pytest.raises(ConfigError):
            VLLMConfig(api_key=bad)


def test_secret_looking_server_env_values_are_masked_and_may_be_references(monkeypatch):
    monkeypatch.setenv("BATON_TEST_TOKEN", SECRET)
    cfg = {"inference": {"vllm": {"api_key": "", "env": {"HF_TOKEN": SECRET, "WANDB_API_KEY": "env:BATON_TEST_TOKEN",
                                                          "db_password": SECRET, "VLLM_CPU_KVCACHE_SPACE": "4",
                                                          "TOKENIZERS_PARALLELISM": "false"}}}}
    shown = redact(cfg)["inference"]["vllm"]["env"]
    assert shown == {"HF_TOKEN": "***", "WANDB_API_KEY": "env:BATON_TEST_TOKEN", "db_password": "***",
                     "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false"}
    assert cfg["inference"]["vllm"]["env"]["HF_TOKEN"] == SECRET  # a copy is masked, not the config
    spec = _build(VLLMConfig(env={"HF_TOKEN": "env:BATON_TEST_TOKEN", "OTHER": "x"}))
    assert spec.env["HF_TOKEN"] == SECRET and spec.env["OTHER"] == "x"
    argv = redact_argv([f"inference.vllm.env.HF_TOKEN={SECRET}", "inference.vllm.env.HF_TOKEN=env:T",
                        f"inference.vllm.env={{HF_TOKEN: {SECRET}, OTHER: x}}", "inference.vllm.env.OTHER=x"])
    assert argv == ["inference.vllm.env.HF_TOKEN=***", "inference.vllm.env.HF_TOKEN=env:T",
                    "inference.vllm.env={HF_TOKEN: '***', OTHER: x}", "inference.vllm.env.OTHER=x"]


@pytest.mark.parametrize("override", [
    f"inference.vllm.api_key=[{SECRET}]", f"inference.vllm.api_key={{a: {SECRET}}}", f"inference.vllm.api_key=[{SECRET}",
    f"inference.vllm.api_key=env:{SECRET}-x", f"inference.vllm.env={{HF_TOKEN: [{SECRET}]}}",
    f"inference.vllm.env={SECRET}", f"inference.vllm.env=[{SECRET}", f"inference.vllm.env={{MY_KEY: env:{SECRET}-x}}"])
def test_a_bad_secret_value_is_refused_without_echoing_it(override):
    with pytest.raises(ConfigError) as info:
        load_run_config([], [override])
    assert SECRET not in str(info.value) and override.split("=")[0] in str(info.value)


def test_an_unset_env_reference_in_the_server_env_is_named_at_the_input_check(monkeypatch):
    monkeypatch.delenv("BATON_TEST_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="inference.vllm.env.HF_TOKEN=env:BATON_TEST_TOKEN: environment variable "
                                          "BATON_TEST_TOKEN is not set"):
        VLLMConfig(env={"HF_TOKEN": "env:BATON_TEST_TOKEN"}).resolved_env()


def _data_and_model(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    train, ev = arithmetic_tasks(64, 8, digits=2, seed=1)   # 64: the default tasks.tasks_per_iteration
    write_tasks(data / "train.jsonl", train)
    write_tasks(data / "eval.jsonl", ev)
    return data, weightless_model(tmp_path / "model")


def test_literal_secrets_never_reach_config_yaml_claims_dry_runs_or_messages(tmp_path):
    data, model = _data_and_model(tmp_path)
    log = tmp_path / "run"
    log.mkdir(mode=0o750)
    args = [RUN_SH, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both", "--eval-interval", "1",
            f"model.path={model}", "tasks.reward=tests.e2e_rewards:starts_with_digit",
            f"inference.vllm.api_key={SECRET}", f"inference.vllm.env={{HF_TOKEN: {SECRET}}}",
            "coordination.heartbeat_interval=0.5", "coordination.peer_timeout=3"]
    dry = subprocess.run(args + ["--dry-run"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "api_key: '***'" in dry.stdout and "HF_TOKEN: '***'" in dry.stdout
    assert dry.stderr.count("visible to every user through ps") == 2
    res = subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode != 0  # the empty model folder ends it at phase 1
    for text in (dry.stdout, dry.stderr, res.stdout, res.stderr):
        assert SECRET not in text
    lay = RunLayout(log)
    assert "api_key: '***'" in lay.config_yaml.read_text() and "HF_TOKEN: '***'" in lay.config_yaml.read_text()
    command = shlex.split(json.loads(lay.job("both").claim(0, 1).read_text())["data"]["command"])
    assert "inference.vllm.api_key=***" in command and "inference.vllm.env={HF_TOKEN: '***'}" in command
    leaked = [p for p in log.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


WRAPPERS = [("run.sh", ["--help"]), ("status.sh", ["--help"]), ("recover.sh", ["--help"]), ("report.sh", ["--help"])]


@pytest.mark.parametrize("pythonpath", ["{root}", "{root}:", ":{root}", "{root}::{root}/tests"])
@pytest.mark.parametrize("script,args", WRAPPERS)
def test_entrypoints_never_import_from_the_current_folder(tmp_path, script, args, pythonpath):
    """`python -m` put the current folder first on the import path: a click.py there ran as click.
    An empty PYTHONPATH entry means the current folder too, and `python -P` keeps it."""
    marker = tmp_path / "MARKER"
    here = tmp_path / "somewhere"
    here.mkdir()
    (here / "click.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\nraise SystemExit(9)\n")
    e = env(PYTHONPATH=pythonpath.format(root=ROOT))
    e.pop("PYTHONSAFEPATH", None)
    res = subprocess.run([str(ROOT / "scripts" / script), *args], cwd=here, env=e, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not marker.exists()


def test_bench_never_changes_the_mode_of_a_log_path_it_did_not_create(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_bytes(b"mine")
    log = tmp_path / "mine"
    log.mkdir()
    os.chmod(log, 0o700)
    res = subprocess.run([sys.executable, "-m", "coordination.bench", "--nodes", "2", "--iterations", "2",
                          "--log-path", str(log), "--straggler-seconds", "0", "--json"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert stat.S_IMODE(log.stat().st_mode) == 0o700
    assert [p.name for p in victim.iterdir()] == ["keep.txt"] and (victim / "keep.txt").read_bytes() == b"mine"
