"""The torchrun recipe (command and environment) and the `train` config section."""
from __future__ import annotations

import dataclasses

import pytest

from coordination.config import ConfigError, field_help, from_dict
from train.config import TrainConfig
from train.launch import torchrun_command, torchrun_env


def test_command_uses_c10d_rendezvous_with_host_flag_and_local_address():
    cmd = torchrun_command(python="/venv/bin/python", nnodes=2, node_rank=1, nproc_per_node=4,
                           rdzv_endpoint="10.0.0.1:29400", rdzv_id="run-3-a2", is_host=False,
                           local_addr="10.0.0.2", module="train.trainer", args=["--plan", "P", "--attempt", "2"])
    assert cmd[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    flags = dict(zip(cmd[3:-5:2], cmd[4:-5:2]))
    assert flags == {"--nnodes": "2", "--node-rank": "1", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                     "--rdzv-endpoint": "10.0.0.1:29400", "--rdzv-id": "run-3-a2", "--rdzv-conf": "is_host=0",
                     "--max-restarts": "0", "--local-addr": "10.0.0.2"}
    assert cmd[-5:] == ["train.trainer", "--plan", "P", "--attempt", "2"] and cmd[-6] == "-m"


def test_master_hosts_the_store_and_local_addr_is_optional():
    cmd = torchrun_command(python="py", nnodes=1, node_rank=0, nproc_per_node=1, rdzv_endpoint="h:1", rdzv_id="x",
                           is_host=True, local_addr=None, module="m", args=[], join_timeout=90)
    assert "is_host=1,join_timeout=90" in cmd and "--local-addr" not in cmd


@pytest.mark.parametrize("kw, match", [({"node_rank": 2}, "node_rank"), ({"rdzv_endpoint": "nohost"}, "HOST:PORT"),
                                       ({"nnodes": 0}, "at least 1")])
def test_bad_launch_arguments_are_refused(kw, match):
    args = dict(python="py", nnodes=2, node_rank=0, nproc_per_node=1, rdzv_endpoint="h:1", rdzv_id="x",
                is_host=True, local_addr=None, module="m", args=[])
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        torchrun_command(**args)


def test_environment_sets_threads_and_socket_interfaces():
    env = torchrun_env({"PATH": "/bin", "OMP_NUM_THREADS": "8"}, omp_threads=1, socket_ifname="eth1")
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert "GLOO_SOCKET_IFNAME" not in torchrun_env({}, omp_threads=2, socket_ifname=None)


def test_defaults_are_the_settings_that_learn_on_the_tiny_model():
    cfg = TrainConfig()
    assert (cfg.algorithm, cfg.lr, cfg.clip_low, cfg.clip_high, cfg.steps_per_iteration, cfg.grad_clip) == \
        ("grpo", 2e-4, 0.2, 0.28, 4, 1.0)
    assert cfg.advantage_std_normalize and cfg.std_eps == 1e-4 and cfg.kl_coef == 0.0
    assert (cfg.max_attempts, cfg.keep_last, cfg.nproc_per_node, cfg.dtype, cfg.rft_min_reward) == (2, 3, 1, "auto", 1.0)


def test_every_field_has_help():
    assert all(field_help(TrainConfig)[f.name] for f in dataclasses.fields(TrainConfig))


@pytest.mark.parametrize("data, match", [
    ({"clip_low": 1.0}, r"train.clip_low must be in \[0, 1\).*got 1.0"),
    ({"lr_schedule": "cosine"}, "lr_decay_steps"),
    ({"betas": [0.9]}, "train.betas"),
    ({"keep_last": 0}, "train.keep_last must be at least 1"),
    ({"micro_batch_tokens": 4}, "micro_batch_tokens must be at least 16"),
    ({"backend": "zero3"}, "backend must be one of"),
    ({"epochs": 3}, "epochs must be at least 1 and divide"),
])
def test_bad_values_name_the_key_value_and_fix(data, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(TrainConfig, data)


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    from train.optim import lr_at

    kw = dict(lr=1.0, schedule="cosine", warmup_steps=2, decay_steps=12, min_ratio=0.1)
    assert [lr_at(s, **kw) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(7, **kw) == pytest.approx(0.55)          # halfway through the decay
    assert lr_at(12, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1)


@pytest.mark.parametrize("body, code, says", [
    ("print('done', flush=True)", 0, "done"),
    ("raise ValueError('bad shard 3')", 1, "ValueError: bad shard 3"),
    ("raise SystemExit(7)", 7, ""),
])
def test_run_worker_exits_with_the_outcome_and_prints_the_traceback(tmp_path, body, code, says):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "w.py"
    script.write_text(f"from train.launch import run_worker\n\ndef work():\n    {body}\n\nrun_worker(work)\n"
                      "print('never reached')\n")
    repo = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(script)], cwd=repo, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert res.returncode == code, res.stderr
    assert says in res.stdout + res.stderr and "never reached" not in res.stdout
