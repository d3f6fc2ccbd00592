"""A checkpoint is this run's, file by file: real checkpoints written by the trainer's own code
(save_checkpoint: DCP optimizer shards, the weights, the marker) in one process, then another
run's weights or optimizer shard put in place of this run's file as a symbolic link, a hard link
or a copy of the same size. The marker's size check passes for all of them; the completeness
check (what the driver asks before serving and the trainer before loading) and the loaders
themselves refuse each one in one line naming the file and both runs, and leave the other run's
files unchanged."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from coordination.checkpoints import CheckpointError, is_complete
from coordination.layout import RunLayout
from tests.test_train_optim_state import _trained

SHARD = "optimizer/shard-00001-model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def written(tmp_path_factory, process_group):
    """Checkpoints written by save_checkpoint: run-a's iterations 1 and 2, run-b's iteration 1, all
    of the same model (so every weight file and shard has the same size in each)."""
    from train.export import prepare_output_dir, save_checkpoint
    from train.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("checkpoints")
    base = write_tiny_model(root / "base", layers=2)
    policy, opt = _trained(base, process_group, "fsdp")
    out = {"base": base}
    for run_id, iteration in (("run-a", 1), ("run-a", 2), ("run-b", 1)):
        folder = root / f"{run_id}-iter-{iteration}"
        prepare_output_dir(folder, process_group)
        save_checkpoint(folder, policy=policy, optimizer=opt, info=process_group, backend="fsdp", run_id=run_id,
                        iteration=iteration, tokenizer_source=base,
                        trainer_state={"optimizer_step": 1, "iteration": iteration})
        out[(run_id, iteration)] = folder
    return out


def _ours(written, tmp_path: Path) -> Path:
    """run-a's iteration 1, published in a run folder of run-a."""
    folder = RunLayout(tmp_path / "run").checkpoint(1)
    folder.parent.mkdir(parents=True)
    shutil.copytree(written[("run-a", 1)], folder)
    return folder


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _plant(how: str, source: Path, target: Path) -> None:
    target.unlink()
    if how == "symlink":
        target.symlink_to(source)
    elif how == "hardlink":
        os.link(source, target)
    else:
        shutil.copyfile(source, target)


@pytest.mark.parametrize("rel", ["model.safetensors", SHARD], ids=["weights", "optimizer-shard"])
@pytest.mark.parametrize("how", ["symlink", "hardlink", "copy"])
@pytest.mark.parametrize("origin", [("run-b", 1), ("run-a", 2)], ids=["another-run", "another-iteration"])
def test_a_linked_or_copied_file_of_another_checkpoint_is_refused_at_load(written, tmp_path, process_group, rel, how,
                                                                            origin):
    from train.build import load_model
    from train.config import TrainConfig
    from train.export import read_trainer_state
    from train.model import Policy, load_causal_lm
    from train.optim import build_optimizer
    from train.optim_state import load_optimizer_state

    folder = _ours(written, tmp_path)
    victim = written[origin]
    before = _digest(victim)
    target, source = folder / rel, victim / rel
    assert target.stat().st_size == source.stat().st_size, "the sizes must agree, or the size check alone refuses"
    _plant(how, source, target)

    with pytest.raises(CheckpointError) as refused:
        is_complete(folder, run_id="run-a")
    message = str(refused.value)
    assert "\n" not in message and str(target) in message and "run run-a, iteration 1" in message, message
    if how == "symlink":
        assert f"symbolic link (to {source})" in message, message
    else:
        assert f"run {origin[0]}, iteration {origin[1]}" in message, message
    assert "move" in message and str(folder) in message, message

    with pytest.raises(CheckpointError, match=f"{target}.*run run-a, iteration 1"):
        if rel == SHARD:
            plain = Policy(load_causal_lm(written["base"]))
            load_optimizer_state(folder, build_optimizer(plain.parameters(), TrainConfig()), plain)
        else:
            load_model(TrainConfig(), folder, read_trainer_state(folder))
    assert _digest(victim) == before, "the other run's files changed"


def test_a_linked_optimizer_folder_and_a_hard_linked_config_are_refused_too(written, tmp_path):
    """A link on a folder below the checkpoint (optimizer/ -> another run's) and a second name on
    a file that carries no stamp (config.json, identical in both runs) pass a size check alike."""
    folder = _ours(written, tmp_path)
    other = written[("run-b", 1)]
    shutil.rmtree(folder / "optimizer")
    (folder / "optimizer").symlink_to(other / "optimizer")
    with pytest.raises(CheckpointError) as refused:
        is_complete(folder, run_id="run-a")
    assert f"{folder / 'optimizer'} is a symbolic link (to {other / 'optimizer'})" in str(refused.value)
    (folder / "optimizer").unlink()
    shutil.copytree(written[("run-a", 1)] / "optimizer", folder / "optimizer")
    assert is_complete(folder, run_id="run-a")
    _plant("hardlink", other / "config.json", folder / "config.json")
    with pytest.raises(CheckpointError) as refused:
        is_complete(folder, run_id="run-a")
    assert f"{folder / 'config.json'} has 2 names" in str(refused.value)


def test_a_checkpoint_as_written_is_complete_stamped_and_loads_in_transformers_dcp_and_the_trainer(written, tmp_path,
                                                                                                  process_group):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from train.build import load_model, make_trainable
    from train.config import TrainConfig
    from train.export import read_trainer_state
    from train.model import Policy, load_causal_lm
    from train.optim import build_optimizer
    from train.optim_state import load_optimizer_state

    folder = _ours(written, tmp_path)
    assert is_complete(folder, run_id="run-a")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "baton.run_id": "run-a", "baton.iteration": "1"}
    with safe_open(str(folder / SHARD), framework="pt") as f:
        meta = f.metadata()
        assert meta["baton.run_id"] == "run-a" and meta["baton.iteration"] == "1" and meta["format"] == "pt"
        assert "DCP_SHARDING_INFO" in meta
    lm = AutoModelForCausalLM.from_pretrained(str(folder))
    base = AutoModelForCausalLM.from_pretrained(str(written["base"]))
    assert not torch.equal(lm.model.norm.weight, base.model.norm.weight), "the trained weights were not loaded"
    plain = Policy(load_causal_lm(written["base"]))
    opt = build_optimizer(plain.parameters(), TrainConfig())
    assert load_optimizer_state(folder, opt, plain) == (len(list(plain.parameters())), True)
    loaded = load_model(TrainConfig(), folder, read_trainer_state(folder))
    assert loaded.sharded
    t = make_trainable(loaded, TrainConfig(), process_group)
    assert torch.equal(dict(t.policy.lm.named_parameters())["model.norm.weight"].full_tensor(), lm.model.norm.weight)


def test_a_base_model_is_the_users_folder_and_may_link_or_leave_unstamped_its_weights(written, tmp_path):
    """The base model lies outside the run folder and is not this run's checkpoint: the Hugging
    Face cache keeps a model's files as links into its blob store, and an SFT output written
    before weights were stamped has a marker but unstamped files. Both load."""
    from train.build import load_model
    from train.config import TrainConfig
    from train.export import read_trainer_state

    RunLayout(tmp_path / "run")  # this process works in a run folder, as a trainer does
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(written["base"], blobs)
    snapshot.mkdir()
    for p in blobs.iterdir():
        (snapshot / p.name).symlink_to(p)
    assert load_model(TrainConfig(), snapshot, None).sharded
    older = tmp_path / "sft-output"
    shutil.copytree(written[("run-b", 1)], older)
    shutil.copyfile(written["base"] / "model.safetensors", older / "model.safetensors")
    assert load_model(TrainConfig(), older, read_trainer_state(older)).sharded


def test_a_damaged_completeness_marker_names_what_repairs_it(tmp_path):
    """baton never rewrites a published checkpoint and `recover` neither repairs one nor moves
    LATEST back, so the refusal names the two ways out that exist: a copy, or a new run started
    from the last good checkpoint."""
    from coordination.checkpoints import MARKER, stamp_of

    layout = RunLayout(tmp_path / "run")
    folder = layout.checkpoint(2)
    folder.mkdir(parents=True)
    (folder / MARKER).write_bytes(b"{half a rec")
    with pytest.raises(CheckpointError, match="completeness marker is damaged") as refused:
        stamp_of(folder)
    assert "model.path set to the last good checkpoint" in str(refused.value)
    assert "recover" not in str(refused.value)
