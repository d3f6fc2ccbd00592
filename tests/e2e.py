"""Helpers of the end-to-end tests: a tiny model and task set made once per session, and the
scripts/run.sh command lines of the nodes."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from coordination.layout import RunLayout
from tests.procs import ROOT, Procs

RUN_SH = str(ROOT / "scripts" / "run.sh")

# Small and fast, on the real code paths: 2 iterations, 24 tasks x 4 samples, FSDP on gloo.
FAST = ["tasks.tasks_per_iteration=24", "tasks.eval_tasks=16", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "rollout.chunk_groups=4", "rollout.prompts_per_call=8",
        "tasks.reward=tests.e2e_rewards:starts_with_digit", "train.steps_per_iteration=2",
        "coordination.heartbeat_interval=0.5", "coordination.peer_timeout=6", "coordination.rejoin_timeout=120",
        "logging.wandb.mode=disabled"]


def make_assets(root: Path) -> tuple[Path, Path]:
    """(data folder, model folder) under `root`, built once."""
    from rollout.tasks import arithmetic_tasks, write_tasks
    from train.tiny import write_tiny_model

    data, model = root / "data", root / "model"
    if not (data / "eval.jsonl").exists():
        train, ev = arithmetic_tasks(1200, 40, digits=2, seed=3)
        data.mkdir(parents=True, exist_ok=True)
        write_tasks(data / "train.jsonl", train)
        write_tasks(data / "eval.jsonl", ev)
    if not (model / "config.json").exists():
        write_tiny_model(model, layers=2, seed=1)
    return data, model


def weightless_model(folder: Path) -> Path:
    """A tiny model folder without its weights: its config and tokenizer pass the input checks at
    join, and the run stops at its first phase, after join wrote its records."""
    from train.tiny import write_tiny_model

    write_tiny_model(folder, layers=1)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    return folder


def node_cmd(data: Path, model: Path, log: Path, *flags: str, overrides: tuple[str, ...] = ()) -> list[str]:
    return [RUN_SH, "--data-path", str(data), "--log-path", str(log), *flags, f"model.path={model}",
            *FAST, *overrides]


def fresh_log(tmp: Path, name: str = "run") -> Path:
    p = tmp / name
    p.mkdir(mode=0o750)
    os.chmod(p, 0o750)
    return p


def checkpoints_load(lay: RunLayout, iterations: list[int], base: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from coordination.checkpoints import is_complete

    ref = AutoModelForCausalLM.from_pretrained(base).state_dict()
    for it in iterations:
        folder = lay.checkpoint(it)
        assert is_complete(folder), f"checkpoint {it} incomplete"
        sd = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert set(sd) == set(ref)
    last = AutoModelForCausalLM.from_pretrained(lay.checkpoint(iterations[-1])).state_dict()
    assert any(not torch.equal(last[k], ref[k]) for k in ref), "training never changed a parameter"


def rows(lay: RunLayout, it: int, split: str = "train"):
    from rollout import store

    return store.read_table(lay.rollout_all(split, it))


def kill_and_restart(procs: Procs, name: str, cmd: list[str], when, before_restart=lambda: None) -> None:
    """SIGKILL `name`'s process group once `when()` holds, run `before_restart()` (the killed
    node's files as it left them), then start `cmd` again as `name`-again."""
    deadline = time.monotonic() + 300
    while not when():
        assert time.monotonic() < deadline, f"the moment to kill {name} never came:\n{procs.log(name)[-2000:]}"
        assert procs.procs[name].poll() is None, f"{name} ended early:\n{procs.log(name)[-3000:]}"
        time.sleep(0.05)
    procs.signal(name, signal.SIGKILL)
    procs.wait(name, 30)
    before_restart()
    procs.start(f"{name}-again", cmd)


def check_complete_run(lay: RunLayout, iterations: int, tasks: int, group: int, base: Path) -> None:
    for it in range(1, iterations + 1):
        t = rows(lay, it)
        pairs = list(zip(t["task_id"].to_pylist(), t["sample_index"].to_pylist()))
        assert len(pairs) == tasks * group and len(set(pairs)) == len(pairs), f"iteration {it}: lost or duplicated"
    checkpoints_load(lay, list(range(1, iterations + 1)), base)


def max_logprob_gap(table, base: Path, adapter: Path | None = None, temperature: float = 1.0, rows: int = 24) -> float:
    """Largest difference between the sampling logprobs in `table` and a transformers (+ peft) forward
    pass of `base` with `adapter` over the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    worst = 0.0
    for row in table.slice(0, rows).to_pylist():
        prompt, completion = row["prompt_ids"], row["completion_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits / temperature if temperature else logits, -1)
        expected = logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
        worst = max(worst, float((expected - torch.tensor(row["logprobs"])).abs().max()))
    return worst
