"""The judge behind an OpenAI-compatible URL: `batch_size` chat-completion requests in flight,
each bounded by `tasks.judge.timeout` (docs/design.md §7)."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait

from coordination.config import resolve_secret
from rollout.judge.config import JudgeConfig
from rollout.judge.score import Failed


class HttpBackend:
    def __init__(self, cfg: JudgeConfig):
        self.cfg = cfg
        self.endpoint = cfg.url.rstrip("/") + "/chat/completions"
        # Read now, so a key that is not there fails the start, not the first rollout; kept out of
        # every message and log line.
        self._key = resolve_secret(cfg.api_key, "tasks.judge.api_key") if cfg.api_key else ""
        self._pool = ThreadPoolExecutor(max_workers=cfg.batch_size, thread_name_prefix="judge call")

    def _post(self, prompt: str, attempt: int) -> str | Failed:
        body = {"model": self.cfg.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.cfg.max_new_tokens, "temperature": self.cfg.temperature, "seed": attempt}
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        request = urllib.request.Request(self.endpoint, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.cfg.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode("utf-8", "replace")
            return Failed(f"HTTP {exc.code} from {self.endpoint}: {detail}")
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (socket.timeout, TimeoutError)):
                return self._late()
            return Failed(f"{self.endpoint} did not answer: {type(reason).__name__}: {reason}")
        try:
            content = json.loads(raw)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return Failed(f"{self.endpoint} sent no chat completion: {raw[:200]!r}")
        if not isinstance(content, str):
            return Failed(f"{self.endpoint} sent a completion whose content is {type(content).__name__}")
        return content

    def ask(self, prompts: list[str], attempt: int) -> list[str | Failed]:
        futures = [self._pool.submit(self._post, p, attempt) for p in prompts]
        # The socket timeout bounds each read; this bounds a server that trickles bytes past it.
        wait(futures, timeout=self.cfg.timeout + 1.0)
        return [f.result() if f.done() else self._late() for f in futures]

    def _late(self) -> Failed:
        return Failed(f"{self.endpoint} gave no answer within tasks.judge.timeout={self.cfg.timeout:g} s")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
