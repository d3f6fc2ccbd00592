"""scripts/run.sh: every misuse exits 2 with a one-line reason and the usage (issue 5 item 1)."""
from __future__ import annotations

import subprocess

import pytest

from tests.procs import ROOT, env

RUN = str(ROOT / "scripts" / "run.sh")
BASE = ["--data-path", "/tmp/d", "--log-path", "/tmp/l"]

MISUSE = [
    ([], {}, "Missing option '--data-path'"),
    (BASE, {}, "--rl-phase rollout|update|both is required (or --bench"),
    (BASE + ["--bench", "--rl-phase", "update"], {}, "--bench benchmarks the trainer on fake data and takes no --rl-phase"),
    (BASE + ["--bench", "--eval-interval", "1"], {}, "takes no --eval-interval; drop it"),
    (BASE + ["--rl-phase", "update", "--bench-steps", "3"], {}, "--bench-steps only applies with --bench"),
    (BASE + ["--bench", "--bench-steps", "0"], {}, "Invalid value for '--bench-steps'"),
    (BASE + ["--rl-phase", "both"], {}, "--eval-interval K is required with --rl-phase both"),
    (BASE + ["--rl-phase", "rollout"], {}, "--rollout-split train-only|eval-only is required"),
    (BASE + ["--rl-phase", "update", "--rollout-split", "train-only"], {}, "--rollout-split only applies"),
    (BASE + ["--rl-phase", "sideways"], {}, "Invalid value for '--rl-phase'"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "two"], {}, "'two' is not a valid integer"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "0"], {}, "--num-nodes must be at least 1"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--master"], {}, "--rank-weights is required"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "3", "--rank-weights", "1,1", "--master"], {},
     "--rank-weights has 2 weight(s) but --num-nodes is 3"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "1,x", "--master"], {},
     "'x' is not a number"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "0,0", "--master"], {},
     "--rank-weights '0,0': rank weights [0.0, 0.0] sum to zero; at least one rank needs a positive weight"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "1,-1", "--master"], {},
     "--rank-weights '1,-1': rank weight 1 is -1.0; weights must be finite numbers >= 0"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "3", "--rank-weights", "1,1,1", "--worker", "3"], {},
     "--worker rank must be between 1 and 2 for 3 nodes (got 3)"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "1,1", "--master", "--worker", "1"], {},
     "--master and --worker are exclusive"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "1,1", "--worker", "0"], {},
     "--worker 0 is the master"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "1,1"], {}, "say which node this is"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "1,1", "--worker", "1"], {"RANK": "0"},
     "the command line says rank 1 but RANK/NODE_RANK says 0"),
    (BASE + ["--rl-phase", "update", "--num-nodes", "2", "--rank-weights", "1,1"], {"NODE_RANK": "5"},
     "--worker rank must be between 1 and 1 for 2 nodes (got 5)"),
    (BASE + ["--rl-phase", "update", "--frobnicate"], {}, "No such option '--frobnicate'"),
    (BASE + ["--rl-phase", "update", "train.lr"], {}, "unexpected argument 'train.lr'"),
    (BASE + ["--rl-phase", "update", "--eval-interval", "-1"], {},
     "run.eval_interval must be 0 or a positive number of iterations (got -1); give --eval-interval K"),
]


@pytest.mark.parametrize("args,extra_env,message", MISUSE, ids=[m[2][:40] for m in MISUSE])
def test_misuse_exits_2_with_a_reason_and_the_usage(args, extra_env, message):
    e = env(**extra_env)
    for var in ("RANK", "NODE_RANK"):
        if var not in extra_env:
            e.pop(var, None)
    res = subprocess.run([RUN, *args], env=e, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr, res.stderr
    assert "Usage: scripts/run.sh" in res.stderr


def test_unknown_config_key_is_refused_with_the_closest_keys(tmp_path):
    res = subprocess.run([RUN, "--data-path", str(tmp_path), "--log-path", str(tmp_path / "l"), "--rl-phase", "update",
                          "train.lrr=1e-4"], env=env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "unknown config key 'train.lrr'; did you mean train.lr" in res.stderr
    assert not (tmp_path / "l").exists(), "a refused command must not create the log path"


def test_help_is_instant_and_imports_nothing_heavy():
    code = ("import sys; from click.testing import CliRunner; from rl.run_cli import main; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output; "
            "print('torch' in sys.modules or 'transformers' in sys.modules)")
    res = subprocess.run(["python3" if False else str(ROOT / ".venv/bin/python"), "-c", code], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "False", res.stderr


@pytest.mark.parametrize("override,message", [
    ("train.dp_replicate=2", "train.dp_replicate=2 does not divide the number of trainer processes (3"),
    ("train.attn=flash_attention_2", "needs the flash-attn package"),
])
def test_training_settings_the_trainer_would_refuse_stop_the_node_at_start(tmp_path, override, message):
    res = subprocess.run([RUN, "--data-path", str(tmp_path), "--log-path", str(tmp_path / "l"), "--rl-phase", "update",
                          "--num-nodes", "3", "--rank-weights", "1,1,1", "--master", "model.path=/m", override],
                         env=env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / "l").exists()
