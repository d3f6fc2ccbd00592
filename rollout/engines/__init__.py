"""Inference engines behind the `rollout.engine.Engine` interface (transformers on CPU, vLLM server),
and `make_engine`, the one place that turns the `inference` config section into one."""
from __future__ import annotations

from pathlib import Path

from coordination.config import ConfigError
from coordination.procgroup import START_TIMEOUT
from rollout.engine import Engine
from rollout.inference import InferenceConfig, resolve_dtype


def make_engine(cfg: InferenceConfig, *, rank: int, restart_count: int, temperature: float,
                log_file: Path | None, debug_mode: bool = False, start_timeout: float = START_TIMEOUT) -> Engine:
    """The engine `cfg` describes, not yet started. `temperature` is the rollout sampling temperature
    (the vLLM server must know it to return logprobs of the tempered distribution); `restart_count`
    counts this rank's engine starts so each start gets its own server seed."""
    if cfg.engine == "transformers":
        # Imported here, not at the top: only the chosen engine's libraries load (torch and
        # transformers for this one, httpx for vLLM), which keeps `--help` and dry runs fast.
        import torch

        from rollout.engines.transformers_engine import TransformersEngine

        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return TransformersEngine(device=device, dtype=resolve_dtype(cfg, on_gpu=device.startswith("cuda")),
                                  max_batch_sequences=cfg.max_batch_sequences)
    from rollout.engines.vllm_engine import VLLMEngine  # imported on demand, as above

    if debug_mode and not cfg.vllm.debug_url:
        raise ConfigError(
            "--debug-mode with inference.engine=vllm uses a server you started yourself: set "
            "inference.vllm.debug_url=http://HOST:PORT (or run without --debug-mode to let baton start it)")
    return VLLMEngine(cfg.vllm, between_iterations=cfg.between_iterations,
                      dtype=resolve_dtype(cfg, on_gpu=not cfg.vllm.cpu), rank=rank,
                      restart_count=restart_count, temperature=temperature, log_file=log_file,
                      debug_mode=debug_mode, start_timeout=start_timeout)
