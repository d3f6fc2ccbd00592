"""Checkpoint publication (complete folder renamed into place, then LATEST) and retention."""
from __future__ import annotations

from pathlib import Path

import pytest

from coordination.layout import RunLayout
from coordination.checkpoints import (CheckpointError, apply_retention, is_complete, mark_complete,
                              publish_checkpoint, read_latest)
from tests.ckpt_support import stamped_file


def _staged(layout: RunLayout, iteration: int, attempt: int = 1, complete: bool = True) -> Path:
    folder = layout.checkpoint_staging(iteration, attempt)
    stamped_file(folder / "model.safetensors", "run-a", iteration, 100 + iteration)
    (folder / "config.json").write_text("{}")
    stamped_file(folder / "optimizer" / "rank-0.safetensors", "run-a", iteration, 10)
    if complete:
        mark_complete(folder, iteration=iteration, run_id="run-a")
    return folder


def test_publication_renames_the_complete_folder_then_moves_latest(tmp_path):
    layout = RunLayout(tmp_path)
    assert read_latest(layout) is None
    staging = _staged(layout, 1)
    final = publish_checkpoint(layout, 1, staging, run_id="run-a")
    assert final == layout.checkpoint(1) and not staging.exists()
    assert is_complete(final)
    assert read_latest(layout) == (1, layout.checkpoint(1))


def test_publication_is_idempotent_and_cleans_a_duplicate_staging_folder(tmp_path):
    layout = RunLayout(tmp_path)
    publish_checkpoint(layout, 1, _staged(layout, 1), run_id="run-a")
    before = (layout.checkpoint(1) / "model.safetensors").stat().st_mtime_ns
    duplicate = _staged(layout, 1, attempt=2)
    assert publish_checkpoint(layout, 1, duplicate, run_id="run-a") == layout.checkpoint(1)
    assert not duplicate.exists()
    assert (layout.checkpoint(1) / "model.safetensors").stat().st_mtime_ns == before
    assert publish_checkpoint(layout, 1, layout.checkpoint_staging(1, 3), run_id="run-a") == layout.checkpoint(1)


def test_latest_never_moves_backwards(tmp_path):
    layout = RunLayout(tmp_path)
    publish_checkpoint(layout, 2, _staged(layout, 2), run_id="run-a")
    publish_checkpoint(layout, 1, _staged(layout, 1), run_id="run-a")
    assert read_latest(layout)[0] == 2
    assert layout.checkpoint(1).exists()


def test_incomplete_staging_is_refused_and_nothing_moves(tmp_path):
    layout = RunLayout(tmp_path)
    staging = _staged(layout, 1, complete=False)
    with pytest.raises(CheckpointError, match="incomplete"):
        publish_checkpoint(layout, 1, staging, run_id="run-a")
    assert not layout.checkpoint(1).exists() and read_latest(layout) is None


def test_a_file_changed_after_marking_makes_the_folder_incomplete(tmp_path):
    layout = RunLayout(tmp_path)
    staging = _staged(layout, 1)
    assert is_complete(staging)
    (staging / "model.safetensors").write_bytes(b"short")
    assert not is_complete(staging)
    (staging / "model.safetensors").unlink()
    assert not is_complete(staging)




def test_retention_keeps_last_k_protected_and_latest_and_removes_dead_staging(tmp_path):
    layout = RunLayout(tmp_path)
    for it in range(1, 7):
        publish_checkpoint(layout, it, _staged(layout, it), run_id="run-a")
    dead = _staged(layout, 4, attempt=2, complete=False)        # a failed attempt of a published iteration
    live = _staged(layout, 7, attempt=1, complete=False)        # the attempt being trained now
    removed = apply_retention(layout, keep_last=2, protected={1, 3})
    assert removed == [2, 4]
    assert [it for it in range(1, 7) if layout.checkpoint(it).exists()] == [1, 3, 5, 6]
    assert not dead.exists() and live.exists()
    assert apply_retention(layout, keep_last=2, protected={1, 3}) == []


def test_retention_never_removes_latest_even_when_newer_folders_are_unpublished(tmp_path):
    layout = RunLayout(tmp_path)
    for it in (1, 2, 3):
        publish_checkpoint(layout, it, _staged(layout, it), run_id="run-a")
    # iteration 4 was renamed into place but its LATEST update never happened (crash in between)
    folder = _staged(layout, 4)
    folder.rename(layout.checkpoint(4))
    removed = apply_retention(layout, keep_last=1, protected=set())
    assert removed == [1, 2]
    assert layout.checkpoint(3).exists() and layout.checkpoint(4).exists()


def _deferred(layout: RunLayout, iteration: int) -> Path:
    """A published checkpoint whose trainer state says its optimizer state follows (a resident
    trainer's), without that state yet."""
    from coordination.records import publish_record

    folder = layout.checkpoint_staging(iteration, 1)
    stamped_file(folder / "model.safetensors", "run-a", iteration, 100 + iteration)
    publish_record(folder / "trainer_state.json", "trainer-state", {"optimizer_deferred": True}, run_id="run-a",
                   generation=0)
    mark_complete(folder, iteration=iteration, run_id="run-a")
    return publish_checkpoint(layout, iteration, folder, run_id="run-a")


def _optimizer_staging(layout: RunLayout, iteration: int, attempt: int = 1, complete: bool = True) -> Path:
    folder = layout.optimizer_staging(iteration, attempt)
    stamped_file(folder / "shard-00001-model-00001-of-00001.safetensors", "run-a", iteration, 10 + iteration)
    if complete:
        mark_complete(folder, iteration=iteration, run_id="run-a")
    return folder


def test_the_optimizer_state_moves_into_its_published_checkpoint_once_complete(tmp_path):
    from coordination.checkpoints import optimizer_pending, publish_optimizer

    layout = RunLayout(tmp_path)
    _deferred(layout, 1)
    assert optimizer_pending(layout.checkpoint(1))
    with pytest.raises(CheckpointError, match="incomplete"):
        publish_optimizer(layout, 1, _optimizer_staging(layout, 1, complete=False), run_id="run-a")
    assert optimizer_pending(layout.checkpoint(1)) and not (layout.checkpoint(1) / "optimizer").exists()
    staging = _optimizer_staging(layout, 1, attempt=2)
    assert publish_optimizer(layout, 1, staging, run_id="run-a") == layout.checkpoint(1) / "optimizer"
    assert not staging.exists() and not optimizer_pending(layout.checkpoint(1))
    assert is_complete(layout.checkpoint(1))  # the weights' marker does not list optimizer/: still complete
    again = _optimizer_staging(layout, 1, attempt=3)  # a second writer (a replay): the first one's is kept
    publish_optimizer(layout, 1, again, run_id="run-a")
    assert not again.exists() and (layout.checkpoint(1) / "optimizer" / "shard-00001-model-00001-of-00001.safetensors").exists()
    with pytest.raises(CheckpointError, match="not a published checkpoint"):
        publish_optimizer(layout, 2, _optimizer_staging(layout, 2), run_id="run-a")


def test_retention_keeps_the_newest_checkpoint_with_its_optimizer_state_while_a_newer_one_waits(tmp_path):
    """keep_last=1, but checkpoint 3's optimizer state is still being written: checkpoint 2 (the
    newest with its state) stays, since a crash now replays iteration 3 from it. Optimizer staging
    folders of iterations up to 2 are dead; 3's is being written and stays."""
    from coordination.checkpoints import publish_optimizer

    layout = RunLayout(tmp_path)
    for it in (1, 2):
        _deferred(layout, it)
        publish_optimizer(layout, it, _optimizer_staging(layout, it), run_id="run-a")
    _deferred(layout, 3)
    dead = _optimizer_staging(layout, 2, attempt=2, complete=False)
    writing = _optimizer_staging(layout, 3, complete=False)
    assert apply_retention(layout, keep_last=1, protected=set()) == [1]
    assert layout.checkpoint(2).exists() and layout.checkpoint(3).exists()
    assert not dead.exists() and writing.exists()
    publish_optimizer(layout, 3, _optimizer_staging(layout, 3, attempt=2), run_id="run-a")
    assert apply_retention(layout, keep_last=1, protected=set()) == [2]
    assert not writing.exists()
