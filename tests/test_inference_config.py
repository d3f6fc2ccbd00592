"""The `inference` config section: defaults, YAML shape, refusals, and make_engine's choice."""
from __future__ import annotations

import dataclasses

import pytest

from coordination.config import ConfigError, field_help, from_dict
from rollout.engines import make_engine
from rollout.inference import InferenceConfig, VLLMConfig, is_loopback


def test_defaults_are_transformers_auto_on_loopback():
    cfg = from_dict(InferenceConfig, {})
    assert (cfg.engine, cfg.between_iterations, cfg.dtype, cfg.device) == ("transformers", "auto", "auto", "auto")
    assert (cfg.vllm.host, cfg.vllm.port, cfg.vllm.api_key, cfg.vllm.served_model_name) == ("127.0.0.1", 0, "", "policy")


@pytest.mark.parametrize("overrides, expected", [
    ([], "reload"),                                                      # transformers engine, resident trainer
    (["train.resident=false"], "restart"),                               # the reference behaviour
    (["inference.engine=vllm"], "sleep"),                                # vLLM on GPU, loopback
    (["inference.engine=vllm", "inference.vllm.cpu=true"], "restart"),   # vLLM on CPU cannot reload a tied head
    (["inference.engine=vllm", "inference.vllm.host=10.1.2.3", "inference.vllm.api_key=env:K"], "restart"),
    (["inference.engine=vllm", "inference.between_iterations=reload"], "reload"),  # an explicit mode stays
])
def test_auto_between_iterations_is_resolved_once_in_the_run_config(overrides, expected):
    from rl.runconfig import load_run_config

    cfg = load_run_config([], ["model.path=/m", *overrides])
    assert cfg.inference.between_iterations == expected


def test_every_field_has_help_text():
    helps = field_help(InferenceConfig)
    assert "vllm.cpu" in helps and "vllm.debug_url" in helps and "between_iterations" in helps
    assert all(text.strip() for text in helps.values()), [k for k, v in helps.items() if not v.strip()]


def test_yaml_mapping_builds_the_nested_vllm_section():
    cfg = from_dict(InferenceConfig, {
        "engine": "vllm", "between_iterations": "reload",
        "vllm": {"cpu": True, "python": "/opt/vllm/bin/python", "env": {"VLLM_CPU_KVCACHE_SPACE": "2"},
                 "extra_args": ["--max-num-batched-tokens", "4096"], "max_concurrency": 8}})
    assert isinstance(cfg.vllm, VLLMConfig)
    assert cfg.vllm.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert cfg.vllm.extra_args == ["--max-num-batched-tokens", "4096"]
    assert (cfg.vllm.cpu, cfg.vllm.max_concurrency) == (True, 8)


@pytest.mark.parametrize("mode", ["reload", "sleep"])
def test_dev_routes_on_a_public_host_are_refused_with_the_fix(mode):
    with pytest.raises(ConfigError) as err:
        from_dict(InferenceConfig, {"engine": "vllm", "between_iterations": mode, "vllm": {"host": "0.0.0.0"}})
    msg = str(err.value)
    assert f"between_iterations={mode}" in msg and "0.0.0.0" in msg
    assert "127.0.0.1" in msg and "restart" in msg


def test_restart_on_a_public_host_is_allowed():
    cfg = from_dict(InferenceConfig, {"engine": "vllm", "vllm": {"host": "0.0.0.0"}})
    assert cfg.vllm.host == "0.0.0.0"


def test_dev_routes_on_ipv6_loopback_are_allowed():
    cfg = from_dict(InferenceConfig, {"engine": "vllm", "between_iterations": "sleep", "vllm": {"host": "::1"}})
    assert cfg.between_iterations == "sleep"


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("localhost", True), ("::1", True),
    ("0.0.0.0", False), ("10.0.0.5", False), ("::", False), ("node17", False)])
def test_loopback_detection(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("data, key, value", [
    ({"vllm": {"port": 70000}}, "inference.vllm.port", "70000"),
    ({"vllm": {"gpu_memory_utilization": 1.5}}, "inference.vllm.gpu_memory_utilization", "1.5"),
    ({"vllm": {"max_concurrency": -1}}, "inference.vllm.max_concurrency", "-1"),
    ({"vllm": {"max_num_seqs": -1}}, "inference.vllm.max_num_seqs", "-1"),
    ({"vllm": {"retries": -1}}, "inference.vllm.retries", "-1"),
    ({"vllm": {"sleep_level": 3}}, "inference.vllm.sleep_level", "3"),
    ({"vllm": {"startup_timeout": 0}}, "inference.vllm.startup_timeout", "0"),
    ({"vllm": {"debug_url": "localhost:8000"}}, "inference.vllm.debug_url", "localhost:8000"),
    ({"vllm": {"served_model_name": " "}}, "inference.vllm.served_model_name", "empty"),
    ({"vllm": {"max_lora_rank": 4}}, "inference.vllm.max_lora_rank", "4"),
    ({"engine": "sglang"}, "inference.engine", "sglang"),
    ({"between_iterations": "hot-swap"}, "inference.between_iterations", "hot-swap"),
    ({"dtype": "int8"}, "inference.dtype", "int8"),
    ({"max_batch_sequences": 0}, "inference.max_batch_sequences", "0"),
])
def test_bad_values_are_refused_naming_key_and_value(data, key, value):
    # Loaded as the driver does: the section sits under `inference` in the composed config.
    @dataclasses.dataclass
    class Root:
        inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)

    with pytest.raises(ConfigError) as err:
        from_dict(Root, {"inference": data})
    assert key in str(err.value) and value in str(err.value)


@pytest.mark.parametrize("arg", ["--port", "--port=8000", "--api-key", "--served-model-name", "--logprobs-mode",
                                 "--seed=3", "--model", "--enable-lora", "--max-lora-rank=64", "--max-loras",
                                 "--max-num-seqs=64", "--api-server-count"])
def test_extra_args_may_not_override_flags_baton_sets(arg):
    with pytest.raises(ConfigError) as err:
        VLLMConfig(extra_args=["--max-num-batched-tokens", "8192", arg])
    assert arg in str(err.value) and "extra_args" in str(err.value)


@pytest.mark.parametrize("name", ["VLLM_SERVER_DEV_MODE", "VLLM_API_KEY", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"])
def test_env_may_not_set_variables_baton_manages(name):
    with pytest.raises(ConfigError) as err:
        VLLMConfig(env={name: "1"})
    assert name in str(err.value)


def test_debug_mode_with_vllm_needs_a_debug_url():
    cfg = InferenceConfig(engine="vllm")
    with pytest.raises(ConfigError) as err:
        make_engine(cfg, rank=0, restart_count=0, temperature=1.0, log_file=None, debug_mode=True)
    assert "inference.vllm.debug_url" in str(err.value)


def test_make_engine_builds_the_vllm_engine_with_the_rollout_temperature(tmp_path):
    from rollout.engines.vllm_engine import VLLMEngine

    cfg = InferenceConfig(engine="vllm", between_iterations="reload", vllm=VLLMConfig(cpu=True))
    engine = make_engine(cfg, rank=3, restart_count=2, temperature=0.7, log_file=tmp_path / "v.log")
    assert isinstance(engine, VLLMEngine)
    assert (engine.rank, engine.restart_count, engine.temperature, engine.dtype) == (3, 2, 0.7, "float32")
    assert engine.between_iterations == "reload" and not engine.running


def test_make_engine_resolves_auto_dtype_and_device_for_transformers():
    from rollout.engines.transformers_engine import TransformersEngine

    engine = make_engine(InferenceConfig(device="cpu", max_batch_sequences=7), rank=0, restart_count=0,
                         temperature=1.0, log_file=None)
    assert isinstance(engine, TransformersEngine)
    assert (engine.device, engine.dtype, engine.max_batch_sequences) == ("cpu", "float32", 7)


def test_max_lora_rank_takes_the_ranks_vllm_accepts_and_suggests_the_next():
    assert [VLLMConfig(max_lora_rank=r).max_lora_rank for r in (0, 1, 8, 16, 512)] == [0, 1, 8, 16, 512]
    with pytest.raises(ConfigError) as err:
        VLLMConfig(max_lora_rank=12)
    assert "use 16" in str(err.value) and "or 0" in str(err.value)


def test_adapters_published_for_vllm_need_lora_serving_at_start_up(tmp_path):
    from coordination.config import load
    from rl.jobs import BOTH, ROLLOUT, UPDATE
    from rl.runconfig import RunConfig

    def cfg(*over):
        return load(RunConfig, [], [f"model.path={tmp_path}", "inference.engine=vllm", "train.lora.rank=16",
                                    "train.lora.publish=adapters", *over])

    with pytest.raises(ConfigError) as err:
        cfg("inference.vllm.max_lora_rank=8").check_for(BOTH)
    assert "inference.vllm.max_lora_rank=16" in str(err.value) and "train.lora.publish=merged" in str(err.value)
    cfg("inference.vllm.max_lora_rank=16").check_for(BOTH)
    cfg().check_for(UPDATE)                                    # an update job serves nothing
    cfg("train.lora.publish=merged").check_for(ROLLOUT)        # merged checkpoints are served as they are
    cfg("inference.vllm.debug_url=http://127.0.0.1:8000").check_for(BOTH)  # the user's server decides


@pytest.mark.parametrize("dp, seqs, n, window", [
    (1, 0, 8, 256),     # vLLM's default max_num_seqs counts as 1024: 2 x 1024 / 8
    (8, 0, 8, 2048),    # scales with the data-parallel engines
    (2, 256, 16, 64),   # 2 x 2 x 256 / 16
    (1, 128, 1, 256),   # eval: one greedy sample per request
    (1, 100, 3, 67),    # rounded up, so the batch is full
])
def test_the_request_window_fills_every_engine_batch_and_as_many_waiting(dp, seqs, n, window):
    assert VLLMConfig(data_parallel_size=dp, max_num_seqs=seqs).requests_in_flight(n) == window


def test_an_explicit_max_concurrency_is_the_window():
    assert VLLMConfig(data_parallel_size=8, max_concurrency=8).requests_in_flight(8) == 8
