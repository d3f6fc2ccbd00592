"""Config values a run cannot use are refused when the config is read, naming the key or file:
infinite and not-a-number floats for every float key, and config files that are not UTF-8."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from coordination.config import ConfigError, flatten
from rl.runconfig import DEFAULT_YAML, load_run_config
from tests.e2e import RUN_SH
from tests.procs import ROOT, env

FLOAT_KEYS = [k for k, v in flatten(yaml.safe_load(DEFAULT_YAML.read_text())).items() if isinstance(v, float)]


def test_the_float_keys_are_found():
    assert len(FLOAT_KEYS) > 20 and "train.lr" in FLOAT_KEYS and "coordination.peer_timeout" in FLOAT_KEYS


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_infinity_and_nan_naming_the_key(key, value):
    with pytest.raises(ConfigError) as info:
        load_run_config([], [f"{key}={value}"])
    assert str(info.value).startswith(f"{key} must be a finite number (got ")


def test_a_non_finite_value_in_a_yaml_file_is_refused_too(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=r"^train.lr must be a finite number \(got inf\)"):
        load_run_config([f], [])


def test_a_config_file_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("# réglages\ntrain:\n  lr: 1.0e-4\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^config file {f}:1: not UTF-8 text \(byte 0xe9\); save it as UTF-8$"):
        load_run_config([f], [])
    data, log = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    log.mkdir(mode=0o750)
    res = subprocess.run([RUN_SH, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both",
                          "--eval-interval", "1", "--config", str(f), "train.lr=.inf"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{f}:1: not UTF-8 text" in res.stderr and list(log.iterdir()) == []


def test_run_sh_refuses_an_infinite_timeout_before_writing(tmp_path):
    data, log = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    log.mkdir(mode=0o750)
    res = subprocess.run([RUN_SH, "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both",
                          "--eval-interval", "1", "coordination.peer_timeout=.inf"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "coordination.peer_timeout must be a finite number (got inf)" in res.stderr and list(log.iterdir()) == []


@pytest.mark.parametrize("text, key, value", [
    ("train.lr=1e-6", "lr", 1e-6), ("train.lr=3E-4", "lr", 3e-4), ("train.lr=+2.5e+1", "lr", 25.0),
    ("train.lr=2.0e-4", "lr", 2e-4), ("train.max_attempts=1_000", "max_attempts", 1000),
])
def test_numbers_are_read_as_users_write_them(text, key, value):
    # PyYAML reads YAML 1.1, where 1e-6 (no dot) is a string: every ML user's learning rate was refused.
    train = load_run_config([], [text]).train
    assert getattr(train, key) == value and type(getattr(train, key)) is type(value)


def test_a_learning_rate_with_an_exponent_is_a_number_in_a_yaml_file_too(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 1e-6\n", encoding="utf-8")
    assert load_run_config([f], []).train.lr == 1e-6


@pytest.mark.parametrize("text", ["train.lr=abc", "train.lr=1e", "train.lr=e-6", "train.lr=1e-6x"])
def test_what_is_not_a_number_is_still_refused_naming_the_value(text):
    with pytest.raises(ConfigError, match=r"train.lr must be a number \(got '"):
        load_run_config([], [text])


def test_strings_stay_strings():
    cfg = load_run_config([], ["model.path=1e5-run", "tasks.reward=pkg.mod:fn"])
    assert cfg.model.path == "1e5-run" and cfg.tasks.reward == "pkg.mod:fn"


def test_every_bad_value_is_named_at_once_across_sections(tmp_path):
    """Three bad values in three sections: one start (or dry run) names all three, before writing."""
    log = tmp_path / "run"
    res = subprocess.run([RUN_SH, "--data-path", str(tmp_path), "--log-path", str(log), "--rl-phase", "update",
                          "model.path=/m", "train.lr=abc", "rollout.group_size=-1", "run.max_iterations=x",
                          "--dry-run"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    for says in ("train.lr must be a number (got 'abc')", "rollout.group_size must be positive (got -1)",
                 "run.max_iterations must be an integer (got 'x')"):
        assert says in res.stderr, res.stderr
    assert not log.exists()
