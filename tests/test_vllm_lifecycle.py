"""Lifecycle of the vLLM engine against a stand-in server: a module named
vllm.entrypoints.cli.main put first on the server's PYTHONPATH, so the engine launches it exactly as
it launches `vllm serve`. It serves the routes the engine uses (or fails, or hangs) and keeps a
child process in its group, as vLLM's engine core does. Sampling itself is tested against real
vLLM in test_vllm_real.py."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from coordination.net import free_port
from rollout.engine import EngineError, Sampling
from rollout.engines import vllm_server
from rollout.engines.vllm_engine import VLLMEngine
from rollout.inference import VLLMConfig
from tests.procs import ROOT, env

STAND_IN = r'''
import argparse, json, os, signal, subprocess, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode = os.environ.get("FAKE_MODE", "serve")
p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--served-model-name")
args, _ = p.parse_known_args()
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN) if %r else None; time.sleep(600)"
    % (mode == "stubborn")])
with open(os.environ["FAKE_PIDS"], "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
print("stand-in server starting", flush=True)
if mode == "fail":
    print("ValueError: head_dim 16 is not supported by the CPU attention backend", file=sys.stderr, flush=True)
    child.kill()
    sys.exit(3)
if mode in ("hang", "stubborn"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN) if mode == "stubborn" else None
    threading.Event().wait()
failures = {"left": int(os.environ.get("FAKE_FAIL_FIRST", "0"))}

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def reply(self, code, payload):
        body = json.dumps(payload).encode()
        self.send_response(code); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, {})
        if self.path == "/v1/models":
            return self.reply(200, {"data": [{"id": args.served_model_name}]})
        self.reply(404, {"detail": "Not Found"})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"] or 0)) or b"{}")
        route = self.path.split("?")[0]
        if os.environ.get("FAKE_DEV") and route in ("/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache"):
            with open(os.environ["FAKE_DEV"], "a") as f:
                f.write(json.dumps({"path": self.path, "body": req}) + "\n")
            return self.reply(200, {"success": True} if route == "/reset_prefix_cache" else {})
        if self.path == "/v1/load_lora_adapter" and os.environ.get("FAKE_LORA"):
            with open(os.environ["FAKE_LORA"], "a") as f:
                f.write(json.dumps({"load": req}) + "\n")
            return self.reply(200, {})
        if self.path != "/v1/completions":
            return self.reply(404, {"detail": "Not Found"})
        if os.environ.get("FAKE_LORA"):
            with open(os.environ["FAKE_LORA"], "a") as f:
                f.write(json.dumps({"model": req["model"]}) + "\n")
        if failures["left"] > 0:
            failures["left"] -= 1
            return self.reply(503, {"error": "overloaded"})
        if req["temperature"] == 0 and req["n"] > 1:
            return self.reply(400, {"error": "n must be 1 when using greedy sampling"})
        last = req["prompt"][-1]
        if os.environ.get("FAKE_TIMES"):  # a slow request for prompts ending in FAKE_SLOW, and when each ran
            begun = time.monotonic()
            slow = json.loads(os.environ.get("FAKE_SLOW", "null"))  # a last token id, or a whole prompt
            time.sleep(1.0 if slow in (last, req["prompt"]) else 0.05)
            with open(os.environ["FAKE_TIMES"], "a") as f:
                f.write(json.dumps({"last": last, "begun": begun, "ended": time.monotonic()}) + "\n")
        choices = [{"index": j, "text": "x" * (j + 1), "token_ids": [last + j] * j + [2],
                    "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5] * j + [-1.5]}}
                   for j in range(req["n"])]
        self.reply(200, {"choices": choices})

ThreadingHTTPServer((args.host, args.port), H).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path):
    """PYTHONPATH for the server that resolves `vllm.entrypoints.cli.main` (`vllm serve`) and
    `vllm.entrypoints.openai.api_server` (the cpu recipe's) to the stand-in."""
    root = tmp_path / "fake" / "vllm" / "entrypoints"
    for pkg, module in ((root / "cli", "main.py"), (root / "openai", "api_server.py")):
        pkg.mkdir(parents=True, exist_ok=True)
        for d in (pkg, pkg.parent, pkg.parent.parent):
            (d / "__init__.py").write_text("")
        (pkg / module).write_text(STAND_IN)
    return tmp_path / "fake"


@pytest.fixture
def checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    return d


def make(tmp_path, stand_in, mode="serve", temperature=1.0, between_iterations="restart", **cfg) -> VLLMEngine:
    env = {"PYTHONPATH": str(stand_in), "FAKE_MODE": mode, "FAKE_PIDS": str(tmp_path / "pids")}
    env.update(cfg.pop("env", {}))
    cfg.setdefault("startup_timeout", 20.0)
    cfg.setdefault("stop_timeout", 5.0)
    return VLLMEngine(VLLMConfig(env=env, **cfg), temperature=temperature, log_file=tmp_path / "server.log",
                      between_iterations=between_iterations)


def pids(tmp_path) -> list[int]:
    deadline = time.monotonic() + 10
    while not (tmp_path / "pids").exists() or not (tmp_path / "pids").read_text().endswith("\n"):
        if time.monotonic() > deadline:
            raise AssertionError("the stand-in server never wrote its pids")
        time.sleep(0.02)
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_startup_failure_shows_the_log_tail_and_the_command(tmp_path, stand_in, checkpoint):
    (tmp_path / "server.log").write_text("RuntimeError: from an earlier start, not this one\n")
    engine = make(tmp_path, stand_in, mode="fail")
    with pytest.raises(EngineError) as err:
        engine.start(checkpoint)
    msg = str(err.value)
    assert "earlier start" not in msg
    assert "exited with code 3" in msg
    assert "head_dim 16 is not supported" in msg  # from the server log
    assert f"vllm.entrypoints.cli.main serve {checkpoint}" in msg
    assert all(gone(p) for p in pids(tmp_path)) and not engine.running


def test_startup_timeout_kills_the_whole_group_even_when_it_ignores_sigterm(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in, mode="stubborn", startup_timeout=1.5, stop_timeout=0.5)
    with pytest.raises(EngineError) as err:
        engine.start(checkpoint)
    assert "was not ready after 2 s" in str(err.value) and "startup_timeout" in str(err.value)
    leader, child = pids(tmp_path)
    assert gone(leader) and gone(child)
    with pytest.raises(ProcessLookupError):
        os.killpg(leader, 0)


def test_stop_leaves_no_process_of_the_group_and_is_idempotent(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in)
    try:
        engine.start(checkpoint)
        leader, child = pids(tmp_path)
        assert engine.server is not None and engine.server.pgid == leader
        assert os.getpgid(child) == leader and os.getpgid(leader) != os.getpgid(0)
    finally:
        engine.stop()
    assert gone(leader) and gone(child)
    with pytest.raises(ProcessLookupError):
        os.killpg(leader, 0)
    engine.stop()
    assert not engine.running


def test_engine_samples_and_repeats_greedy_completions(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in)
    try:
        engine.start(checkpoint)
        out = engine.generate([[1, 10], [1, 20]], 3, Sampling(max_new_tokens=4, temperature=1.0, seed=5))
        assert [[s.token_ids for s in g] for g in out] == [[[2], [11, 2], [12, 12, 2]], [[2], [21, 2], [22, 22, 2]]]
        assert out[0][2].logprobs == [-0.5, -0.5, -1.5] and out[0][2].finish_reason == "stop"
        greedy = engine.generate([[1, 7]], 3, Sampling(max_new_tokens=4, temperature=0))
        assert [s.token_ids for s in greedy[0]] == [[2], [2], [2]]
        assert engine.stats.samples == 9 and engine.stats.requests == 3
    finally:
        engine.stop()


def test_requests_go_out_as_a_rolling_window_and_each_result_as_it_finishes(tmp_path, stand_in, checkpoint):
    """Window 3, 12 prompts, the first one slow (1 s, the others 0.05 s): while it runs, the other
    two slots keep turning over, so the 11 fast prompts all finish before it (synchronous batches
    of 3 would have waited for it before sending prompt 4); never more than 3 are in flight; each
    result goes to on_result once, in the order they finish."""
    times = tmp_path / "times.jsonl"
    engine = make(tmp_path, stand_in, max_concurrency=3, env={"FAKE_TIMES": str(times), "FAKE_SLOW": "100"})
    got: list[int] = []
    try:
        engine.start(checkpoint)
        prompts = [[1, 100]] + [[1, 200 + i] for i in range(11)]
        out = engine.generate(prompts, 2, Sampling(max_new_tokens=4, temperature=1.0, seed=5),
                              on_result=lambda i, samples: got.append(i) or len(samples) == 2 or got.append(-1))
    finally:
        engine.stop()
    assert out == [] and sorted(got) == list(range(12)) and got[-1] == 0
    assert engine.stats.samples == 24 and engine.stats.requests == 12
    runs = [json.loads(line) for line in times.read_text().splitlines()]
    slow = next(r for r in runs if r["last"] == 100)
    assert all(r["ended"] <= slow["ended"] for r in runs)
    # the first three go out together; the other 9 start while the slow one runs
    assert sum(slow["begun"] < r["begun"] < slow["ended"] for r in runs) >= 9
    edges = sorted([(r["begun"], 1) for r in runs] + [(r["ended"], -1) for r in runs], key=lambda e: (e[0], e[1]))
    in_flight = peak = 0
    for _, step in edges:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak <= 3


def test_transient_errors_are_retried(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in, retries=2, env={"FAKE_FAIL_FIRST": "2"})
    try:
        engine.start(checkpoint)
        out = engine.generate([[1, 30]], 1, Sampling(max_new_tokens=2))
        assert out[0][0].token_ids == [2]
    finally:
        engine.stop()


def test_a_server_that_keeps_failing_raises_after_bounded_retries(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in, retries=2, env={"FAKE_FAIL_FIRST": "100"})
    try:
        engine.start(checkpoint)
        t0 = time.monotonic()
        with pytest.raises(EngineError) as err:
            engine.generate([[1, 30]], 1, Sampling(max_new_tokens=2))
        assert time.monotonic() - t0 < 10
        msg = str(err.value)
        assert f"{engine.client.base_url}/v1/completions failed 3 times" in msg and "HTTP 503" in msg
    finally:
        engine.stop()


def test_a_dead_server_is_reported_with_its_log(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in, retries=5)
    try:
        engine.start(checkpoint)
        os.killpg(engine.server.pgid, signal.SIGKILL)
        engine.server.proc.wait(timeout=10)
        with pytest.raises(EngineError) as err:
            engine.generate([[1, 30]], 1, Sampling(max_new_tokens=2))
        assert "exited with code -9" in str(err.value) and "stand-in server starting" in str(err.value)
    finally:
        engine.stop()


def test_requests_whose_logprobs_would_break_the_convention_are_refused(tmp_path, stand_in, checkpoint):
    raw = make(tmp_path, stand_in, temperature=1.0)
    try:
        raw.start(checkpoint)
        with pytest.raises(EngineError, match="started for temperature 1"):
            raw.generate([[1, 5]], 2, Sampling(max_new_tokens=2, temperature=0.7))
        with pytest.raises(EngineError, match="below 0.01"):
            raw.generate([[1, 5]], 2, Sampling(max_new_tokens=2, temperature=0.005))
        raw.generate([[1, 5]], 2, Sampling(max_new_tokens=2, temperature=1.0, top_p=0.9))  # raw == convention
    finally:
        raw.stop()
    processed = make(tmp_path, stand_in, temperature=0.7)
    try:
        processed.start(checkpoint)
        with pytest.raises(EngineError, match="top-p truncation"):
            processed.generate([[1, 5]], 2, Sampling(max_new_tokens=2, temperature=0.7, top_p=0.9))
        processed.generate([[1, 5]], 2, Sampling(max_new_tokens=2, temperature=0.7))
    finally:
        processed.stop()


def test_reload_without_dev_routes_is_refused(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in)
    try:
        engine.start(checkpoint)
        with pytest.raises(EngineError, match="between_iterations=reload or sleep"):
            engine.reload(checkpoint)
    finally:
        engine.stop()


@pytest.mark.parametrize("configured", [1, 2])
def test_a_sleep_before_new_weights_discards_the_old_ones_and_one_before_the_same_keeps_the_level(
        tmp_path, stand_in, checkpoint, configured):
    calls = tmp_path / "dev.jsonl"
    # dev routes on (between_iterations=sleep); the stand-in records what reaches them
    engine = make(tmp_path, stand_in, between_iterations="sleep", env={"FAKE_DEV": str(calls)}, sleep_level=configured)
    nxt = tmp_path / "next"
    nxt.mkdir()
    for name in ("config.json", "model.safetensors"):
        (nxt / name).write_bytes((checkpoint / name).read_bytes())
    try:
        engine.start(checkpoint)
        engine.sleep(new_weights=True)
        engine.wake(nxt)
        engine.sleep()
        engine.wake(nxt)
    finally:
        engine.stop()
    paths = [json.loads(line)["path"] for line in calls.read_text().splitlines()]
    new, same = paths[:paths.index("/reset_prefix_cache") + 1], paths[paths.index("/reset_prefix_cache") + 1:]
    # level 2 whatever was configured: the old weights are not kept, the wake loads the new ones
    assert new == ["/sleep?level=2", "/wake_up?tags=weights", "/collective_rpc", "/wake_up?tags=kv_cache",
                   "/reset_prefix_cache"]
    if configured == 1:  # the same weights next: level 1 keeps them and a plain wake restores them
        assert same == ["/sleep?level=1", "/wake_up", "/reset_prefix_cache"]
    else:
        assert same == ["/sleep?level=2", "/wake_up?tags=weights", "/collective_rpc", "/wake_up?tags=kv_cache",
                        "/reset_prefix_cache"]


def test_sleep_without_dev_routes_stops_and_wake_starts_again(tmp_path, stand_in, checkpoint):
    engine = make(tmp_path, stand_in)
    try:
        engine.start(checkpoint)
        first = engine.server.pgid
        engine.sleep()
        assert not engine.running and gone(first)
        engine.wake(checkpoint)
        assert engine.running and engine.server.pgid != first
        # Each start of one engine gets its own server seed.
        seeds = [engine.spec.argv[engine.spec.argv.index("--seed") + 1]]
        assert seeds == [str(vllm_server.server_seed(0, 0, 1))]
    finally:
        engine.stop()


@pytest.fixture
def users_server(tmp_path, stand_in):
    """A stand-in server started by 'the user' (the test), not by the engine."""
    port = free_port("127.0.0.1")
    env = dict(os.environ, PYTHONPATH=str(stand_in), FAKE_PIDS=str(tmp_path / "user-pids"))
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "their-model", "--host", "127.0.0.1",
                             "--port", str(port), "--served-model-name", "theirs"], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_debug_mode_uses_the_users_server_and_never_starts_or_stops_one(tmp_path, users_server, checkpoint,
                                                                        monkeypatch):
    def no_process(*a, **kw):
        raise AssertionError(f"debug mode launched a process: {a}")

    monkeypatch.setattr(vllm_server.subprocess, "Popen", no_process)
    engine = VLLMEngine(VLLMConfig(debug_url=users_server), debug_mode=True)
    engine.start(checkpoint)
    out = engine.generate([[1, 40]], 2, Sampling(max_new_tokens=3))
    assert [s.token_ids for s in out[0]] == [[2], [41, 2]]
    assert engine.client.model_name == "theirs"  # the user's served name, whatever it is
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(EngineError) as err:
        engine.reload(other)
    assert "VLLM_SERVER_DEV_MODE=1" in str(err.value) and "Restart your server" in str(err.value)
    engine.sleep()
    engine.stop()
    assert not engine.running
    assert httpx.get(users_server + "/health", trust_env=False).status_code == 200  # still theirs, still up


def test_debug_mode_names_the_url_when_the_users_server_is_down(tmp_path, checkpoint):
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    engine = VLLMEngine(VLLMConfig(debug_url=url), debug_mode=True)
    with pytest.raises(EngineError) as err:
        engine.start(checkpoint)
    assert url in str(err.value) and "python -m vllm.entrypoints.cli.main serve" in str(err.value)


def test_start_refuses_a_folder_without_weights(tmp_path, stand_in):
    (tmp_path / "empty").mkdir()
    engine = make(tmp_path, stand_in)
    with pytest.raises(EngineError, match="not a Hugging Face checkpoint"):
        engine.start(tmp_path / "empty")
    assert not (tmp_path / "pids").exists()


def test_cpu_weight_reload_of_a_tied_checkpoint_is_refused_before_launching(tmp_path, stand_in, checkpoint):
    (checkpoint / "config.json").write_text('{"tie_word_embeddings": true}')
    for mode in ("reload", "sleep"):
        engine = VLLMEngine(VLLMConfig(cpu=True, env={"PYTHONPATH": str(stand_in)}), between_iterations=mode,
                            log_file=tmp_path / "server.log")
        with pytest.raises(EngineError) as err:
            engine.start(checkpoint)
        assert "tie_word_embeddings" in str(err.value) and "between_iterations=restart" in str(err.value)
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def test_cpu_weight_reload_of_a_mixture_of_experts_is_refused_before_launching(tmp_path, stand_in, checkpoint):
    for key in ("num_experts", "num_local_experts"):     # Qwen3-MoE's and Mixtral's spelling
        (checkpoint / "config.json").write_text(json.dumps({"tie_word_embeddings": False, key: 4}))
        for mode in ("reload", "sleep"):
            engine = VLLMEngine(VLLMConfig(cpu=True, env={"PYTHONPATH": str(stand_in)}), between_iterations=mode,
                                log_file=tmp_path / "server.log")
            with pytest.raises(EngineError) as err:
                engine.start(checkpoint)
            assert "mixture-of-experts model (4 experts per layer)" in str(err.value)
            assert "between_iterations=restart" in str(err.value)
    assert not (tmp_path / "server.log").exists()  # nothing was launched


def lora_adapter(tmp_path: Path, name: str, rank: int = 8) -> Path:
    """An adapter folder as the trainer publishes it (the stand-in server does not read the weights)."""
    folder = tmp_path / name / "adapter"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_adapters_load_in_place_under_one_name_and_completions_name_them(tmp_path, stand_in, checkpoint):
    events = tmp_path / "lora.jsonl"
    engine = make(tmp_path, stand_in, max_lora_rank=8, env={"FAKE_LORA": str(events)})
    first, second = lora_adapter(tmp_path, "iter-1"), lora_adapter(tmp_path, "iter-2", rank=1)
    sampling = Sampling(max_new_tokens=3)
    try:
        engine.start(checkpoint)
        group = engine.server.pgid
        engine.generate([[1, 40]], 1, sampling)
        engine.set_adapter(first)
        engine.generate([[1, 40]], 1, sampling)
        engine.set_adapter(first)                      # the same (immutable) folder: nothing to load
        engine.set_adapter(second)
        engine.generate([[1, 40]], 1, sampling)
        assert engine.adapter_dir == second.resolve() and engine.server.pgid == group  # never restarted
        engine.set_adapter(None)
        engine.generate([[1, 40]], 1, sampling)
    finally:
        engine.stop()
    load = {"lora_name": "policy-lora", "load_inplace": True}
    assert [json.loads(line) for line in events.read_text().splitlines()] == [
        {"model": "policy"},
        {"load": {**load, "lora_path": str(first.resolve())}}, {"model": "policy-lora"},
        {"load": {**load, "lora_path": str(second.resolve())}}, {"model": "policy-lora"},
        {"model": "policy"}]


def test_set_adapter_refuses_when_lora_serving_is_off_or_too_small(tmp_path, stand_in, checkpoint):
    events = tmp_path / "lora.jsonl"
    wide = lora_adapter(tmp_path, "iter-1", rank=16)
    for max_rank, expected in ((0, "inference.vllm.max_lora_rank=0"), (8, "above inference.vllm.max_lora_rank=8")):
        engine = make(tmp_path, stand_in, max_lora_rank=max_rank, env={"FAKE_LORA": str(events)})
        try:
            engine.start(checkpoint)
            with pytest.raises(EngineError) as err:
                engine.set_adapter(wide)
            assert expected in str(err.value) and "16" in str(err.value)
            with pytest.raises(EngineError, match="not a LoRA adapter folder"):
                engine.set_adapter(checkpoint)
            assert engine.adapter_dir is None and engine.client.model_name == "policy"
        finally:
            engine.stop()
    assert not events.exists()                         # refused before any request


def test_start_on_an_adapters_only_checkpoint_points_at_its_base(tmp_path, stand_in):
    folder = lora_adapter(tmp_path, "iter-3").parent
    with pytest.raises(EngineError, match="lora.base") as err:
        make(tmp_path, stand_in, max_lora_rank=8).start(folder)
    assert "set_adapter" in str(err.value)


def test_debug_mode_names_the_flags_a_users_server_needs_for_adapters(tmp_path, users_server, checkpoint):
    engine = VLLMEngine(VLLMConfig(debug_url=users_server), debug_mode=True)
    engine.start(checkpoint)
    with pytest.raises(EngineError) as err:
        engine.set_adapter(lora_adapter(tmp_path, "iter-1"))
    assert "--enable-lora" in str(err.value) and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(err.value)
    assert engine.client.model_name == "theirs" and engine.adapter_dir is None
    engine.stop()


def test_the_worker_gives_vllm_all_its_tasks_in_one_window_with_exact_counts(tmp_path, stand_in, checkpoint):
    """rollout_rank with the vLLM engine: one call over all 12 tasks (prompts_per_call=2 is for
    in-process engines), so the slow first task holds nothing up; chunks hold whole groups in the
    order they finished, and DONE lists every task once with its group."""
    from coordination.layout import RunLayout
    from coordination.records import read_record
    from rollout.chunks import read_chunk
    from rollout.config import RolloutConfig
    from rollout.prompts import encode_prompt
    from rollout.rewards import load_reward
    from rollout.tasks import arithmetic_tasks
    from rollout.worker import RolloutTarget, Sampler, rollout_rank, sampling_for
    from train.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tasks, _ = arithmetic_tasks(12, 0, seed=3)
    slow = encode_prompt(tokenizer, tasks[0])
    times = tmp_path / "times.jsonl"
    engine = make(tmp_path, stand_in, max_concurrency=3, env={"FAKE_TIMES": str(times), "FAKE_SLOW": json.dumps(slow)})
    layout = RunLayout(tmp_path / "run")
    cfg = RolloutConfig(group_size=3, max_new_tokens=6, chunk_groups=2, prompts_per_call=2)
    sampling, group_size = sampling_for(cfg, "train")
    try:
        engine.start(checkpoint)
        summary = rollout_rank(RolloutTarget(layout, "train", 1, 0, run_id="run-test", generation=1, policy_iteration=0),
                               Sampler(engine, tokenizer, cfg, load_reward("arithmetic"), sampling, group_size), tasks)
    finally:
        engine.stop()
    assert engine.stats.requests == 12 and summary.samples == 36
    done = read_record(layout.rollout_done("train", 1, 0), kind="rollout-done", run_id="run-test")
    listed = [t for c in done.data["chunks"] for t in c["task_ids"]]
    assert sorted(listed) == sorted(t.id for t in tasks) and len(done.data["chunks"]) == 6
    for c in done.data["chunks"]:
        rows = read_chunk(layout.rollout_rank_dir("train", 1, 0) / c["name"], run_id="run-test").to_pylist()
        assert sorted((r["task_id"], r["sample_index"]) for r in rows) == sorted(
            (t, j) for t in c["task_ids"] for j in range(3))
    runs = [json.loads(line) for line in times.read_text().splitlines()]
    slowest = max(runs, key=lambda r: r["ended"] - r["begun"])
    assert len(runs) == 12 and slowest["ended"] - slowest["begun"] >= 1.0
    assert all(r["ended"] <= slowest["ended"] for r in runs)  # the 11 others did not wait for it
    assert listed[-1] == tasks[0].id  # it finished last, so its group is in the last chunk


def test_the_client_raises_its_open_file_limit_to_the_hard_limit():
    # In a child: the limit is the process's. A soft limit of 256 would allow 128 connections.
    code = ("import resource\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
            "from rollout.engines.vllm_client import VLLMClient\n"
            "c = VLLMClient('http://127.0.0.1:1', api_key='', model_name='m', request_timeout=1, window=lambda n: 4096,"
            " retries=0)\n"
            "print(c.open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    client_sees, soft, hard = (int(x) for x in res.stdout.split())
    expected = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert client_sees == soft == expected > 256
