"""`python -m bench --what load-publish`: model load memory and publication time, the full-copy
path against the sharded one (docs/design.md §11.4), on 1 and 2 processes.

`python -m bench.load_publish MODE MODEL OUT` is one rank of one case (under torchrun):
- `current`: every rank loads the whole float32 model with transformers, then FSDP2 shards it;
  publication gathers the full state dict to rank 0, which writes it alone (save_pretrained);
- `sharded`: every rank builds the model on the meta device and reads its shard
  (train/sharded.py); publication has every rank write its share.
Each rank writes `OUT/MODE-wW-rR.json`: its RSS before loading (after the process group and the
imports, the model's transformers class included: code, not weights), its peak RSS by the end of the load, and the seconds from a barrier before publication to
a barrier after it. Publication writes float32 in both modes (the serving dtype on CPU), so both
write the same bytes. The sharded case also writes the optimizer state as the trainer does (DCP
shards), AdamW's moments and the float32 state (`<fqn>::master`) apart (`write_state`): the report's
`fp32_state_write_s_world2` and `checkpoint_bytes` (weights, fp32_state, optimizer) are what the
float32 state costs the background write.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM

from coordination.checkpoint_files import Stamp
from coordination.config import from_dict
from coordination.net import free_port
from coordination.procgroup import stop_group
from train.build import Loaded, load_model, make_trainable
from train.config import TrainConfig
from train.distributed import init_distributed, shutdown
from train.export import prepare_output_dir, write_hf_folder
from train.launch import run_worker, torchrun_command, torchrun_env
from train.lora import weights_source
from train.memory import peak_rss_mb, rss_mb
from train.model import load_causal_lm
from train.optim_state import MASTER, SEP, _flat, _stamping_writer
from train.parallel import full_state_dict
from train.sharded import gather_share, write_config, write_share
from train.tiny import write_tiny_model

MB = 1024 * 1024


def worker(mode: str, model: Path, out: Path) -> None:
    info = init_distributed(600.0)
    # Code is not model: the model's class (transformers imports it lazily, ~90 MB of modules) is
    # imported before the baseline, in both modes alike.
    AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(str(model)))]
    try:
        cfg = from_dict(TrainConfig, {"fused_lm_head_token_chunk_size": "disabled"})
        dist.barrier()
        baseline = rss_mb()
        started = time.monotonic()
        if mode == "current":
            loaded = Loaded(load_causal_lm(model, cfg.attn), weights_source(cfg.lora, model, None))
        else:
            loaded = load_model(cfg, model, None)
        t = make_trainable(loaded, cfg, info)
        del loaded
        load_s = time.monotonic() - started
        peak = peak_rss_mb()
        target = out / f"published-{mode}-w{info.world_size}"
        prepare_output_dir(target, info)
        dist.barrier()
        started = time.monotonic()
        if mode == "current":
            state_dict = full_state_dict(t.policy)
            if info.is_main:
                write_hf_folder(t.policy, state_dict, target, model)
            del state_dict
        else:
            share = gather_share(t.policy, info.rank, info.world_size, torch.float32)
            write_share(share, target, info.rank, Stamp("bench", 0))
            if info.is_main:
                write_config(t.policy, target, torch.float32)
            del share
        dist.barrier()
        publish_s = time.monotonic() - started
        result = {"mode": mode, "world_size": info.world_size, "rank": info.rank, "baseline_rss_mb": baseline,
                  "load_peak_rss_mb": peak, "load_s": load_s, "publish_s": publish_s,
                  "publish_peak_rss_mb": peak_rss_mb()}
        if mode == "sharded":
            result.update(write_state(t, out / f"state-w{info.world_size}"))
        (out / f"{mode}-w{info.world_size}-r{info.rank}.json").write_text(json.dumps(result) + "\n")
    finally:
        shutdown()


def write_state(t, out: Path) -> dict:
    """Collective: the seconds and bytes of the optimizer state as the trainer writes it beside a
    checkpoint (train/optim_state.py: DCP shards, one file per rank), in two parts written apart: AdamW's
    moments, and the float32 value of every trained parameter (the `<fqn>::master` entries). The state is
    a fresh optimizer's (DCP's state dict initialises it): the same shapes and bytes as a trained one."""
    flat, _, _ = _flat(t.policy, t.optimizer)
    parts = {"optimizer": {k: v for k, v in flat.items() if not k.endswith(SEP + MASTER)},
             "fp32_state": {k: v for k, v in flat.items() if k.endswith(SEP + MASTER)}}
    result = {}
    for name, part in parts.items():
        folder = out / name
        dist.barrier()
        started = time.monotonic()
        dcp.save(part, storage_writer=_stamping_writer(folder, Stamp("bench", 0)))
        dist.barrier()
        result[f"{name}_write_s"] = time.monotonic() - started
        result[f"{name}_bytes"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return result


def run_case(root: Path, model: Path, mode: str, procs: int, timeout: float) -> list[dict]:
    """Launch one case under torchrun (one OMP thread per rank); returns the ranks' results."""
    repo = Path(__file__).resolve().parents[1]
    port = free_port("127.0.0.1")
    cmd = torchrun_command(python=sys.executable, nnodes=1, node_rank=0, nproc_per_node=procs,
                           rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"lp-{port}", is_host=True, local_addr=None,
                           module="bench.load_publish", args=[mode, str(model), str(root)])
    env = torchrun_env(dict(os.environ, PYTHONPATH=str(repo)), omp_threads=1, socket_ifname=None)
    log = root / f"{mode}-w{procs}.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = -9
    finally:
        stop_group(proc)
    if rc != 0:
        raise RuntimeError(f"{mode} on {procs} process(es) failed (exit {rc}); see {log}:\n{log.read_text()[-3000:]}")
    return [json.loads((root / f"{mode}-w{procs}-r{r}.json").read_text()) for r in range(procs)]


def bench_model(out: Path) -> Path:
    """A ~200M-parameter Llama (train/tiny.py scaled up: hidden 1024, 13 blocks, GQA 16/4 heads)."""
    return write_tiny_model(out, hidden=1024, layers=13, heads=16, kv_heads=4, intermediate=4096)


def run_load_publish(root: Path, timeout: float = 600.0, echo=lambda text: None) -> dict:
    model = bench_model(root / "model")
    params = json.loads((model / "baton-tiny.json").read_text())["parameters"]
    report: dict = {"model": f"Llama, {params:,} parameters", "model_fp32_mb": round(params * 4 / MB, 1)}
    baselines = []
    for mode in ("current", "sharded"):
        row = {}
        for procs in (1, 2):
            ranks = run_case(root, model, mode, procs, timeout)
            baselines += [r["baseline_rss_mb"] for r in ranks]
            row[f"load_peak_rss_mb_world{procs}"] = round(max(r["load_peak_rss_mb"] for r in ranks), 1)
            row[f"load_s_world{procs}"] = round(max(r["load_s"] for r in ranks), 2)
            row[f"publish_s_world{procs}"] = round(max(r["publish_s"] for r in ranks), 2)
            row[f"rank_baseline_rss_mb_world{procs}"] = round(max(r["baseline_rss_mb"] for r in ranks), 1)
            if mode == "sharded":
                for name in ("optimizer", "fp32_state"):
                    row[f"{name}_write_s_world{procs}"] = round(max(r[f"{name}_write_s"] for r in ranks), 2)
                weights = sum(f.stat().st_size for f in (root / f"published-{mode}-w{procs}").glob("*.safetensors"))
                row[f"checkpoint_bytes_world{procs}"] = {
                    "weights": weights, **{name: ranks[0][f"{name}_bytes"] for name in ("fp32_state", "optimizer")}}
            echo(f"{mode} x{procs}: peak RSS {row[f'load_peak_rss_mb_world{procs}']:,.0f} MB, "
                 f"publish {row[f'publish_s_world{procs}']:.2f} s")
        report[mode] = row
    # The float32 state is written in the trainer's background write (docs/design.md §9.6): its
    # seconds are how long that write grows, not phase 10.
    report["fp32_state_write_s_world2"] = report["sharded"]["fp32_state_write_s_world2"]
    report["optimizer_write_s_world2"] = report["sharded"]["optimizer_write_s_world2"]
    report["checkpoint_bytes"] = report["sharded"]["checkpoint_bytes_world2"]
    # The lowest rank baseline: the conservative one for the target (peak - baseline <= 0.6 x fp32).
    report["baseline_rss_mb"] = round(min(baselines), 1)
    report["sharded_load_over_baseline_ratio_world2"] = round(
        (report["sharded"]["load_peak_rss_mb_world2"] - report["baseline_rss_mb"]) / report["model_fp32_mb"], 3)
    return report


if __name__ == "__main__":
    run_worker(worker, sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
