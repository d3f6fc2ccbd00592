"""The judge as a second engine on the node, and `open_judge`, which picks it or the URL
(docs/design.md §7).

The second engine follows the policy engine's rules: built by `make_engine` from the inference
section (so a vLLM judge is a server in its own process group, started within
coordination.child_start_timeout, stopped by its group), with its own port (a free one), the
served name "judge", `tasks.judge.gpu_memory_utilization` and `tasks.judge.timeout` per request.
The driver opens it at the start of each rollout phase and closes it at its end, so it never
holds memory while the trainer runs.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from coordination import log
from rollout import engines
from rollout.engine import Engine, EngineError, Sampling
from rollout.inference import InferenceConfig
from rollout.judge.config import JudgeConfig
from rollout.judge.http import HttpBackend
from rollout.judge.score import Failed, Judge
from rollout.prompts import chat_ids

_log = log.get("judge")


def judge_inference(inference: InferenceConfig, cfg: JudgeConfig) -> InferenceConfig:
    """The inference section the judge's engine is built from: the policy's, with the judge's
    kind, a port of its own, its memory share and its timeout."""
    vllm = dataclasses.replace(inference.vllm, port=0, served_model_name="judge", max_lora_rank=0, debug_url="",
                               gpu_memory_utilization=cfg.gpu_memory_utilization, request_timeout=cfg.timeout)
    return dataclasses.replace(inference, engine=cfg.engine, between_iterations="restart", vllm=vllm)


class EngineBackend:
    def __init__(self, engine: Engine, tokenizer: Any, cfg: JudgeConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg

    def ask(self, prompts: list[str], attempt: int) -> list[str | Failed]:
        ids = [chat_ids(self.tokenizer, [{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
        sampling = Sampling(self.cfg.max_new_tokens, self.cfg.temperature, 1.0, seed=attempt)
        try:
            results = self.engine.generate(ids, 1, sampling)
        except EngineError as exc:
            return [Failed(f"the judge engine failed: {exc}")] * len(prompts)
        return [samples[0].text for samples in results]

    def close(self) -> None:
        self.engine.stop()
        _log.info("judge engine %s stopped", self.engine.name)


def open_judge(cfg: JudgeConfig, inference: InferenceConfig, *, rank: int, log_file: Path | None,
               start_timeout: float) -> Judge | None:
    """The judge `cfg` asks for, ready to score (None without a template). Close it when done."""
    if not cfg.enabled:
        return None
    if cfg.url:
        return Judge(cfg, HttpBackend(cfg))
    engine = engines.make_engine(judge_inference(inference, cfg), rank=rank, restart_count=0, temperature=1.0,
                                 log_file=log_file, start_timeout=start_timeout)
    try:
        engine.start(Path(cfg.model))
        tokenizer = getattr(engine, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer  # only a vLLM judge needs it here

            tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        _log.info("judge engine %s serves %s for this rollout phase", engine.name, cfg.model)
        return Judge(cfg, EngineBackend(engine, tokenizer, cfg))
    except BaseException:
        engine.stop()
        raise
