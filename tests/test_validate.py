"""One validation of the run's inputs: each rule's message names the value and the fix, a rule
downstream of a failed one stays quiet, and a dry run lists every failure and writes nothing."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

from coordination.config import ConfigError
from rl.args import RunArgs
from rl.jobs import kind_for
from rl.runconfig import load_run_config
from rl.validate import Rule, failures
from rl.validate.flags import FLAG_RULES, Flags, node_rank
from rl.validate.run import RUN_RULES, RunInputs, run_failures
from rollout.split import parse_rank_weights
from rollout.tasks import arithmetic_tasks, write_tasks
from tests.procs import ROOT, env

GPU_EXAMPLE = ROOT / "configs" / "gpu-example.yaml"


def flags(**kw) -> Flags:
    base = dict(rl_phase="update", eval_interval=None, rollout_split=None, num_nodes=1, rank_weights=None,
                master=False, worker=None, environ={})
    return Flags(**{**base, **kw})


W2, W3 = dict(num_nodes=2, rank_weights="1,1"), dict(num_nodes=3, rank_weights="1,1,1")
FLAG_CASES = [  # (flags, rule, what its message must say)
    (dict(bench_given=("bench_steps",)), "bench-options-need-bench", "--bench-steps only applies with --bench"),
    (dict(bench=True, rl_phase=None, eval_interval=2), "bench-takes-no-rl-flags",
     "takes no --eval-interval; drop it"),
    (dict(rl_phase=None), "job-selected", "--rl-phase rollout|update|both is required (or --bench"),
    (dict(rl_phase="both"), "eval-interval-given", "--eval-interval K is required with --rl-phase both"),
    (dict(rl_phase="rollout"), "job-selected", "--rollout-split train-only|eval-only is required"),
    (dict(rollout_split="eval-only"), "job-selected",
     "only applies to --rl-phase rollout (got --rl-phase update)"),
    (dict(num_nodes=0), "num-nodes-positive", "--num-nodes must be at least 1 (got 0)"),
    (dict(num_nodes=2, master=True), "rank-weights",
     "--rank-weights is required with --num-nodes 2: one weight per node, e.g. --rank-weights 1,1"),
    (dict(num_nodes=2, master=True, rank_weights="2,x"), "rank-weights",
     "'x' is not a number; give one weight per node"),
    (dict(num_nodes=2, master=True, rank_weights="1,inf"), "rank-weights",
     "rank weight 1 is inf; weights must be finite"),
    (dict(num_nodes=3, master=True, rank_weights="1,1"), "rank-weights",
     "has 2 weight(s) but --num-nodes is 3; give exactly one per node"),
    (W2, "rank-known", "say which node this is: --master on one node and --worker R (1..1)"),
    (dict(W2, master=True, worker=1), "rank-known", "--master and --worker are exclusive"),
    (dict(W2, worker=0), "rank-known", "--worker 0 is the master: use --master"),
    (dict(W3, worker=3), "rank-known", "between 1 and 2 for 3 nodes (got 3)"),
    (dict(worker=1), "rank-known", "--num-nodes 1 has only the master, but this node says rank 1; use --master"),
    (dict(W2, environ={"RANK": "x"}), "rank-known",
     "RANK='x' in the environment is not a node rank; unset it or give --worker R"),
    (dict(W2, worker=1, environ={"NODE_RANK": "0"}), "rank-known",
     "the command line says rank 1 but RANK/NODE_RANK says 0; drop one of them"),
    (dict(overrides=("train.lr",)), "overrides-are-key-value",
     "unexpected argument 'train.lr': config overrides are key=value, e.g. train.lr=1e-4"),
]


@pytest.mark.parametrize("kw, rule, says", FLAG_CASES, ids=[f"{c[1]}:{i}" for i, c in enumerate(FLAG_CASES)])
def test_each_flag_rule_names_the_value_and_the_fix(kw, rule, says):
    found = failures(FLAG_RULES, flags(**kw))
    assert [f.rule for f in found] == [rule] and says in found[0].message, found


def test_every_flag_rule_has_a_case_and_good_flags_pass():
    assert {r.name for r in FLAG_RULES} == {c[1] for c in FLAG_CASES}
    good = flags(num_nodes=3, rank_weights="2, 1,0.5", worker=2)
    assert failures(FLAG_RULES, good) == [] and node_rank(good) == 2
    assert node_rank(flags(num_nodes=2, rank_weights="1,1", environ={"NODE_RANK": "1"})) == 1


def test_several_bad_flags_are_all_reported_and_a_rule_needing_a_failed_one_is_skipped():
    found = failures(FLAG_RULES, flags(rl_phase="both", eval_interval=None, num_nodes=0, rank_weights="x",
                                       overrides=("oops",)))
    # num-nodes failed: the weights and rank rules, which need a node count, say nothing.
    assert [f.rule for f in found] == ["eval-interval-given", "num-nodes-positive", "overrides-are-key-value"]


def test_rank_weights_have_one_parser_and_one_rule():
    assert parse_rank_weights("2, 1,0") == [2.0, 1.0, 0.0]     # 0: that rank gets no tasks
    for text, says in (("0,0", "sum to zero; at least one rank needs a positive weight"),
                       ("1,-1", "rank weight 1 is -1.0; weights must be finite numbers >= 0"),
                       ("1,nan", "rank weight 1 is nan"), ("1,,2", "'' is not a number")):
        with pytest.raises(ValueError) as err:
            parse_rank_weights(text)
        assert str(err.value).startswith(f"--rank-weights {text!r}: ") and says in str(err.value)


@pytest.mark.parametrize("text, value", [("train.lr=1e-6", 1e-6), ("train.lr=3E-4", 3e-4),
                                         ("train.max_attempts=1_000", 1000)])
def test_override_numbers_are_read_as_the_user_means_them(text, value):
    key = text.split("=")[0].split(".")[1]
    assert getattr(load_run_config([], [text]).train, key) == value


def test_an_override_that_is_not_a_number_is_refused_with_the_value_and_how_to_write_one():
    with pytest.raises(ConfigError) as err:
        load_run_config([], ["train.lr=abc"])
    assert str(err.value) == "train.lr must be a number (got 'abc'); write it as e.g. train.lr=0.0002, train.lr=2e-4 " \
                             "or train.lr=3E-4"


def test_flags_that_are_config_keys_arrive_typed_and_are_checked_once_with_the_config(tmp_path):
    # --data-path is a path, never YAML: `yes` and `a: b` were read as a boolean and a mapping.
    for path in ("yes", "a: b", "1e5"):
        assert load_run_config([], [], {"run.data_path": path}).run.data_path == path
    cfg = load_run_config([], ["run.eval_interval=4"], {"run.eval_interval": 2})
    assert cfg.run.eval_interval == 4                     # the user's key=value still comes last
    messages = []
    for flags_, overrides in (({"run.eval_interval": -1}, []), ({}, ["run.eval_interval=-1"])):
        with pytest.raises(ConfigError) as err:
            load_run_config([], overrides, flags_)
        messages.append(str(err.value))
    assert messages[0] == messages[1] == ("run.eval_interval must be 0 or a positive number of iterations (got -1); "
                                          "give --eval-interval K (or run.eval_interval) with K >= 0, 0 turns "
                                          "evaluation off")


# -- rules of the composed config ----------------------------------------------------------------

def data_folder(root: Path, n_train: int = 64, n_eval: int = 4) -> Path:
    """Task files; 64 train tasks: the default tasks.tasks_per_iteration."""
    data = root / "data"
    if not data.exists():
        train, ev = arithmetic_tasks(n_train, n_eval, digits=2, seed=1)
        data.mkdir(parents=True)
        write_tasks(data / "train.jsonl", train)
        write_tasks(data / "eval.jsonl", ev)
    return data


def inputs(tmp_path: Path, *overrides: str, phase: str = "both", num_nodes: int = 1, configs=(), data=None,
           bench: dict | None = None) -> RunInputs:
    data = data or data_folder(tmp_path)
    split = "train-only" if phase == "rollout" else None
    kind = kind_for(phase, split, bench=bench is not None)
    args = RunArgs(data, tmp_path / "run", kind, 0 if kind.evaluates_on_interval else None,
                   num_nodes, [1.0] * num_nodes, 0, overrides=list(overrides), bench=bench)
    cfg = load_run_config(list(configs), args.overrides, args.config_flags())
    return RunInputs(args, cfg)


def rule_says(r: RunInputs, name: str) -> str | None:
    (rule,) = [x for x in RUN_RULES if x.name == name]
    return rule.check(r)


def test_model_rules_name_the_path_and_the_fix(tmp_path):
    assert "model.path is empty: give the starting checkpoint" in rule_says(inputs(tmp_path), "model-path-given")
    missing = tmp_path / "nope"
    says = rule_says(inputs(tmp_path, f"model.path={missing}"), "model-path-exists")
    assert says == f"model.path={missing} does not exist on this node; every node must see the starting checkpoint " \
                   f"at the same path"
    assert rule_says(inputs(tmp_path, f"model.path={missing}", phase="update"), "model-path-exists") is None
    (tmp_path / "file").write_text("x")
    says = rule_says(inputs(tmp_path, f"model.path={tmp_path / 'file'}", bench={}), "bench-model-is-folder")
    assert "is not a folder on this node" in says and "leave model.path empty" in says
    assert rule_says(inputs(tmp_path, bench={}), "model-path-given") is None   # the tiny model is benchmarked


def test_adapters_published_for_vllm_need_lora_serving_at_start_up(tmp_path):
    def problem(*over, phase="both"):
        return rule_says(inputs(tmp_path, f"model.path={tmp_path}", "inference.engine=vllm", "train.lora.rank=16",
                                "train.lora.publish=adapters", *over, phase=phase), "lora-rank-served")

    refused = problem("inference.vllm.max_lora_rank=8")
    assert "inference.vllm.max_lora_rank=16" in refused and "train.lora.publish=merged" in refused
    assert problem("inference.vllm.max_lora_rank=16") is None
    assert problem(phase="update") is None                                  # an update job serves nothing
    assert problem("train.lora.publish=merged", phase="rollout") is None    # merged checkpoints are served as they are
    assert problem("inference.vllm.debug_url=http://127.0.0.1:8000") is None  # the user's server decides


def test_launch_rules_name_the_setting_and_the_fix(tmp_path):
    says = rule_says(inputs(tmp_path, "train.dp_replicate=2", num_nodes=3), "trainer-world-size")
    assert "train.dp_replicate=2 does not divide the number of trainer processes (3" in says and "[1, 3]" in says
    assert rule_says(inputs(tmp_path, "train.dp_replicate=2", num_nodes=3, phase="rollout"),
                     "trainer-world-size") is None   # a rollout job launches no trainer
    says = rule_says(inputs(tmp_path, "train.attn=flash_attention_2"), "flash-attn-installed")
    if importlib.util.find_spec("flash_attn") is None:
        assert "pip install flash-attn" in says and "train.attn=sdpa" in says
    else:
        assert says is None


def test_task_file_and_reward_rules_name_the_file_or_function_and_the_fix(tmp_path):
    says = rule_says(inputs(tmp_path, data=tmp_path / "empty"), "task-files")
    assert f"train task file {tmp_path / 'empty' / 'train.jsonl'} does not exist" in says
    assert "python -m rollout.tasks make" in says
    says = rule_says(inputs(tmp_path, "tasks.reward=tests.e2e_rewards:returns_nan"), "reward-scores")
    assert "returned nan" in says
    says = rule_says(inputs(tmp_path, "tasks.tasks_per_iteration=65"), "enough-tasks")
    assert says.startswith("tasks.tasks_per_iteration=65 exceeds the 64 tasks of the train file; lower")
    says = rule_says(inputs(tmp_path, "inference.engine=vllm", "inference.vllm.api_key=env:BATON_TEST_UNSET_VAR"),
                     "secrets-resolve")
    assert "BATON_TEST_UNSET_VAR" in says


def test_model_inputs_rule_names_the_model_folder(tmp_path):
    (tmp_path / "m").mkdir()
    says = rule_says(inputs(tmp_path, f"model.path={tmp_path / 'm'}"), "model-fits-inputs")
    assert says.startswith(f"model.path={tmp_path / 'm'} holds no config.json; give a Hugging Face model folder")


def test_memory_rule_refuses_a_trainer_and_engine_that_do_not_fit_with_the_settings_that_do(tmp_path):
    model = tmp_path / "model-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
        "tie_word_embeddings": False, "max_position_embeddings": 4096, "torch_dtype": "float16"}))
    r = inputs(tmp_path, f"model.path={model}", "train.gpu_memory_gib=80", "train.ac.freq=0", configs=[GPU_EXAMPLE])
    says = rule_says(r, "memory-fits")
    peak = re.search(r"trainer \(([\d.]+) GiB peak per GPU\)", says)
    assert peak and float(peak.group(1)) > 80 and "train.ac.freq=1 train.ac.mode=full" in says, says


def test_a_rule_needing_a_failed_rule_is_skipped_so_one_fault_is_reported_once(tmp_path):
    r = inputs(tmp_path, f"model.path={tmp_path / 'nope'}", data=tmp_path / "empty")
    assert [f.rule for f in run_failures(r.args, r.cfg)] == ["model-path-exists", "task-files"]
    calls = []
    rules = (Rule("a", lambda s: "a failed"), Rule("b", lambda s: calls.append("b")), Rule("c", lambda s: "c failed",
                                                                                        needs=("a",)))
    assert [f.rule for f in failures(rules, None)] == ["a"] and calls == ["b"]


def test_dry_run_with_several_bad_inputs_prints_every_failing_rule_exits_2_and_writes_nothing(tmp_path):
    data = data_folder(tmp_path)
    log = tmp_path / "run"
    before = sorted(tmp_path.rglob("*"))
    cmd = [str(ROOT / "scripts/run.sh"), "--data-path", str(data), "--log-path", str(log), "--rl-phase", "both",
           "--eval-interval", "1", "--num-nodes", "3", "--rank-weights", "1,1,1", "--master", "--dry-run",
           f"model.path={tmp_path / 'nope'}", "train.dp_replicate=2", "tasks.eval_tasks=5",
           "tasks.reward=tests.e2e_rewards:raises"]
    res = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    refused = [line.strip() for line in res.stdout.splitlines() if line.strip().startswith("refused:")]
    wanted = [f"model.path={tmp_path / 'nope'} does not exist", "train.dp_replicate=2 does not divide",
              "raised KeyError", "tasks.eval_tasks=5 exceeds the 4 tasks of the eval file"]
    assert len(refused) == len(wanted) and all(w in r for w, r in zip(wanted, refused)), refused
    assert "would stop here (exit 2), 4 problem(s)" in res.stderr
    assert all(w in res.stderr for w in wanted), res.stderr
    assert "## commands this node would run" in res.stdout
    assert not log.exists() and sorted(tmp_path.rglob("*")) == before


def test_a_start_with_several_bad_inputs_refuses_with_every_failing_rule_and_writes_nothing(tmp_path):
    data = data_folder(tmp_path)
    log = tmp_path / "run"
    cmd = [str(ROOT / "scripts/run.sh"), "--data-path", str(data), "--log-path", str(log), "--rl-phase", "update",
           "--num-nodes", "3", "--rank-weights", "1,1,1", "--master", "model.path=/nowhere", "train.dp_replicate=2",
           "train.attn=flash_attention_2"]
    res = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    expected = ["train.dp_replicate=2 does not divide"] + \
        (["train.attn=flash_attention_2 needs the flash-attn package"] if importlib.util.find_spec("flash_attn") is None
         else [])
    assert len(errors) == len(expected) and all(e in line for e, line in zip(expected, errors)), res.stderr
    assert not log.exists()


def test_the_hand_run_rollout_command_reads_rank_weights_by_the_same_rule(tmp_path):
    cmd = [str(ROOT / ".venv/bin/python"), "-m", "rollout.worker", "--log-path", str(tmp_path), "--model-dir",
           str(tmp_path), "--tasks", str(tmp_path / "t.jsonl"), "--run-id", "r", "--rank-weights", "1,-2"]
    res = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "--rank-weights '1,-2': rank weight 1 is -2.0; weights must be finite numbers >= 0" in res.stderr
    assert list(tmp_path.iterdir()) == []
