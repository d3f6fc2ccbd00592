"""Throughput of the vLLM engine on CPU: start (CPU recipe), warm up, measure, reload, stop.

`bench.rollout_speed` calls `measure_vllm` for its table; `python -m bench.vllm_speed --model DIR
--python PY` runs it alone. Prompts are random token ids and completions have a fixed length
(EOS ignored), so runs are comparable across models and checkpoints.
"""
from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import click

from coordination.records import restrict_umask
from rollout.engine import Sampling
from rollout.engines.vllm_engine import VLLMEngine
from rollout.engines.vllm_server import tied_embeddings
from rollout.inference import VLLMConfig


def measure_vllm(model_dir: Path, python: str, *, prompts: int = 64, n: int = 8, max_new_tokens: int = 32,
                 prompt_len: int = 16, log_file: Path | None = None) -> dict:
    """Samples/s and tokens/s of one vLLM server on `model_dir`, plus start, reload and stop times.
    `python` is the interpreter with vLLM installed (e.g. .venv-vllm/bin/python)."""
    model_dir = Path(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    # Ids above 3 skip the tiny tokenizer's specials; any id below vocab_size is a valid prompt token.
    batch = [[rng.randrange(min(4, vocab - 1), vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=1.0, seed=0, stop_at_eos=False)
    # Reload is measured too, unless vLLM on CPU cannot reload this (tied) checkpoint.
    mode = "restart" if tied_embeddings(model_dir) else "reload"
    with tempfile.TemporaryDirectory(prefix="baton-bench-vllm-") as tmp:
        engine = VLLMEngine(VLLMConfig(python=python, cpu=True), between_iterations=mode,
                            log_file=log_file or Path(tmp) / "server.log")
        try:
            t0 = time.perf_counter()
            engine.start(model_dir)
            startup_s = time.perf_counter() - t0
            engine.generate(batch[:4], 2, Sampling(max_new_tokens=4, temperature=1.0, seed=1, stop_at_eos=False))
            t0 = time.perf_counter()
            out = engine.generate(batch, n, sampling)
            generate_s = time.perf_counter() - t0
            reload_s = None
            if mode == "reload":
                t0 = time.perf_counter()
                engine.reload(model_dir)
                reload_s = time.perf_counter() - t0
        finally:
            t0 = time.perf_counter()
            engine.stop()
            stop_s = time.perf_counter() - t0
    samples = sum(len(group) for group in out)
    tokens = sum(len(s.token_ids) for group in out for s in group)
    return {"engine": "vllm", "prompts": prompts, "n": n, "max_new_tokens": max_new_tokens,
            "samples": samples, "tokens": tokens, "generate_s": generate_s,
            "samples_per_s": samples / generate_s, "tokens_per_s": tokens / generate_s,
            "startup_s": startup_s, "reload_s": reload_s, "stop_s": stop_s}


@click.command()
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="Hugging Face checkpoint folder to serve")
@click.option("--python", required=True, help="interpreter of a venv with vLLM, e.g. .venv-vllm/bin/python")
@click.option("--prompts", default=64, show_default=True)
@click.option("--n", default=8, show_default=True, help="samples per prompt")
@click.option("--max-new-tokens", default=32, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
def main(model_dir: Path, python: str, prompts: int, n: int, max_new_tokens: int, as_json: bool) -> None:
    """Measure vLLM-on-CPU throughput on one checkpoint."""
    restrict_umask()  # nothing baton or a library writes is wider than 0o750 / 0o640 (docs/design.md §5 rule 11)
    result = measure_vllm(model_dir, python, prompts=prompts, n=n, max_new_tokens=max_new_tokens)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        click.echo(f"{key:>16}  {value:.3f}" if isinstance(value, float) else f"{key:>16}  {value}")


if __name__ == "__main__":
    main()
