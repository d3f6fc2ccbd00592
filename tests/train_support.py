"""Shared helpers of the train tests: a tiny model, trajectories written by the test, torchrun.

Trajectories carry real sampling logprobs (a forward pass of the model that "sampled" them), so
importance ratios start at 1 as they do after a real rollout.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

from coordination.net import free_port
from coordination.layout import RunLayout
from coordination.procgroup import stop_group
from rollout import store
from rollout.prompts import encode_prompt

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def make_tiny(out: Path, **kw) -> Path:
    from train.tiny import write_tiny_model

    return write_tiny_model(out, **kw)


def model_logprobs(model_dir: Path, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c])
            logits = model(ids).logits[0, len(p) - 1:len(p) + len(c) - 1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
            out.append([float(x) for x in lp])
    return out


def write_trajectories(layout: RunLayout, iteration: int, model_dir: Path, *, tasks: int = 8, samples: int = 4,
                       seed: int = 0, all_same_reward: bool = False, policy_iteration: int = 0) -> int:
    """Arithmetic groups with a mix of right and wrong answers; returns the number of rows."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    rows, prompts, completions = [], [], []
    for t in range(tasks):
        a, b = rng.randrange(100), rng.randrange(100)
        task = {"id": f"t{t}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
        pids = encode_prompt(tok, task)
        for s in range(samples):
            right = (s % 2 == 0) if not all_same_reward else True
            text = str(a + b) if right else str(a + b + rng.randrange(1, 9))
            cids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            prompts.append(pids)
            completions.append(cids)
            rows.append({"task_id": task["id"], "sample_index": s, "prompt": task["prompt"], "prompt_ids": pids,
                         "completion_ids": cids, "text": text, "reward": 1.0 if right else 0.0,
                         "finish_reason": "stop", "policy_iteration": policy_iteration, "iteration": iteration,
                         "split": "train", "rank": 0, "generation": 1, **store.one_turn(len(cids))})
    for row, lp in zip(rows, model_logprobs(model_dir, prompts, completions)):
        row["logprobs"] = lp
    return store.write_rows(layout.rollout_all("train", iteration), rows, run_id="run-t")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["HF_HUB_OFFLINE"] = "1"
    return e


def start(cmd: list[str], log: Path, environ: dict[str, str] | None = None) -> subprocess.Popen:
    fh = open(log, "wb")
    try:
        return subprocess.Popen(cmd, cwd=REPO, env=environ or env(), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        fh.close()


def run_nodes(commands: list[list[str]], logs: list[Path], timeout: float = 240.0) -> list[int]:
    """Start every command in its own process group, wait for all, kill leftovers; exit codes."""
    procs = []
    try:
        for cmd, log in zip(commands, logs):
            procs.append(start(cmd, log))
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
        return [p.returncode for p in procs]
    finally:
        for p in procs:
            stop_group(p, timeout=10)


def run_module(module: str, args: list[str], log: Path, timeout: float = 180.0,
               extra_env: dict[str, str] | None = None) -> int:
    """`python -m module args` in its own process group; its exit code (killed on timeout)."""
    environ = env()
    environ.update(extra_env or {})
    proc = start([PYTHON, "-m", module, *args], log, environ)
    try:
        return proc.wait(timeout)
    finally:
        stop_group(proc, timeout=10)


def publish(plan: Path, attempt: int = 1) -> Path:
    """Phase 11 for a trainer run by hand: rename the attempt's staging folder into place and move
    LATEST (the trainer only stages; publication has one owner, docs/design.md §6)."""
    from coordination.checkpoints import publish_checkpoint
    from coordination.records import read_record

    layout, iteration = RunLayout.from_training_plan(plan)
    return publish_checkpoint(layout, iteration, layout.checkpoint_staging(iteration, attempt),
                              run_id=read_record(plan).run_id)


def prepare(layout: RunLayout, iteration: int, input_checkpoint: Path, input_iteration: int, *, world_size: int = 1,
            reference_model: Path | None = None, **cfg) -> Path:
    from coordination.records import create_record
    from train.config import TrainConfig
    from train.data import prepare_training_data

    cfg.setdefault("micro_batch_tokens", 64)
    # The trainer checks the plan's run_id against run.json, as in a real run folder.
    create_record(layout.run_json, "run", {"config_hash": "test", "created_by": "tests"}, run_id="run-t",
                  generation=0)
    return prepare_training_data(layout, iteration, TrainConfig(**cfg), run_id="run-t", world_size=world_size,
                                 temperature=1.0, input_checkpoint=input_checkpoint, input_iteration=input_iteration,
                                 reference_model=reference_model)


def load_weights(folder: Path) -> dict:
    """All weights of a Hugging Face folder: one model.safetensors or the shards each trainer rank
    wrote (model-0000R-of-0000W.safetensors)."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(folder).glob("model*.safetensors")):
        out.update(load_file(str(path)))
    return out


def optimizer_files(folder: Path) -> list[str]:
    return sorted(p.name for p in (Path(folder) / "optimizer").iterdir())


def optimizer_tensors(folder: Path) -> dict:
    """name::state -> the pieces of it the DCP shard files under optimizer/ hold (train/optim_state.py)."""
    from safetensors import safe_open

    out: dict = {}
    for path in sorted((Path(folder) / "optimizer").glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                out.setdefault(key, []).append(f.get_tensor(key))
    return out


def optimizer_steps(folder: Path) -> set[float]:
    """The AdamW step counts saved with a checkpoint (one per parameter, replicated)."""
    return {float(t) for key, pieces in optimizer_tensors(folder).items() if key.endswith("::step") for t in pieces}


DCP_SHARDS_2 = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]


def torchrun(module: str, args: list[str], logs_dir: Path, *, nnodes: int = 2, nproc_per_node: int = 1,
             timeout: float = 300.0) -> list[int]:
    """One `torchrun --nnodes N` per simulated node on this host (c10d rendezvous on a free port),
    each in its own process group; returns their exit codes."""
    from train.launch import torchrun_command

    port = free_port("127.0.0.1")
    commands = [torchrun_command(python=PYTHON, nnodes=nnodes, node_rank=r, nproc_per_node=nproc_per_node,
                                 rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=f"test-{port}", is_host=r == 0,
                                 local_addr=None, module=module, args=args, join_timeout=120)
                for r in range(nnodes)]
    logs_dir.mkdir(parents=True, exist_ok=True)
    return run_nodes(commands, [logs_dir / f"node{r}.log" for r in range(nnodes)], timeout=timeout)


def logs_text(logs_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs_dir.glob("*.log")))


def write_gathered(results: dict, out: Path, info) -> None:
    """Collective: every rank's `results` merged into one dict, written by rank 0 as `out`/results.json."""
    import json

    import torch.distributed as dist

    all_results = [None] * info.world_size
    dist.all_gather_object(all_results, results)
    if info.is_main:
        (out / "results.json").write_text(json.dumps({k: v for r in all_results for k, v in r.items()}))
