"""Checkpoint folders, their publication and retention (docs/design.md §6 phase 11, §11.4).

A checkpoint is a Hugging Face folder (weights, config, tokenizer, generation config) that vLLM
and transformers load as they are, plus `optimizer/` (DCP shard files, one per trainer rank) and
`trainer_state.json`. The marker `baton-complete.json` is written last and lists every file with
its size; a folder is complete only when the marker validates and the files match: each opened
without following links, none with a second name, each safetensors file stamped with the marker's
run and iteration (coordination/checkpoint_files.py). A resident trainer writes `optimizer/` after
the weights are published, as a folder with its own marker (`publish_optimizer`;
`optimizer_pending` says when it is still missing).

Publication renames a complete staging folder to `checkpoints/iter-N` in one step, and only then
moves `checkpoints/LATEST` (a JSON record) forward. Readers therefore never see a half-written
checkpoint, and LATEST never points at one.

This is a run-folder publication protocol (folder + completeness marker + LATEST + retention) that
knows nothing of GRPO, so it sits in the protocol layer where rollout/ (which serves checkpoints),
train/ (which writes and publishes them) and rl/ (which prunes them) may all import it
(docs/design.md §3).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from coordination.checkpoint_files import CheckpointError, Stamp, check_stamp, open_listed
from coordination.layout import (RunLayout, check_no_links, in_run_folder, iteration_number,
                                 optimizer_staging_identity, staging_identity)
from coordination.records import (Missing, NotThereYet, WrongRun, ensure_dir, fence_check, publish_record,
                                  read_record, remove_tree, try_read)

MARKER = "baton-complete.json"
OPTIMIZER_DIR = "optimizer"
TRAINER_STATE = "trainer_state.json"
ADAPTER_DIR = "adapter"  # LoRA adapters in peft's format (train/lora.py)

_log = logging.getLogger("baton.checkpoints")


def list_files(folder: Path) -> dict[str, int]:
    """Relative path -> size of every file under `folder` except the marker."""
    folder = Path(folder)
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MARKER:
            out[path.relative_to(folder).as_posix()] = path.stat().st_size
    return out


def mark_complete(folder: Path, *, iteration: int, run_id: str, expected: list[str] = ()) -> None:
    """Write the completeness marker last, listing every file in `folder` with its size.

    `expected` names files other nodes wrote: a directory listing on NFS may not show them yet
    (negative lookup caches), but a stat of a known name does, so they are checked by name."""
    folder = Path(folder)
    files = list_files(folder)
    for rel in expected:
        try:
            files[rel] = (folder / rel).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{folder / rel} is missing although its writer reported success; "
                                  f"the shared filesystem lost it: rerun the training attempt") from None
    publish_record(folder / MARKER, "checkpoint-complete", {"iteration": iteration, "files": files},
                   run_id=run_id, generation=0)


def _other_run(path: Path, exc: WrongRun) -> CheckpointError:
    return CheckpointError(
        f"{exc}: it was copied or linked here from another run, and baton never adopts another run's "
        f"checkpoint (its weights and optimizer state would silently replace this run's). Move {path} out of "
        f"the run folder and restart; the iteration is then trained again")


def is_complete(folder: Path, *, run_id: str | None = None) -> bool:
    """True when `folder` holds a valid marker and every file it lists, with the listed size.

    With `run_id` (every caller inside a run) a complete checkpoint of another run raises
    CheckpointError naming both run ids instead of counting as this run's (docs/design.md §5 rule 2),
    as does a listed file that is a link, has a second name, or is stamped with another run or
    iteration than the marker (another run's file under this run's marker, not "not written yet")."""
    folder = Path(folder)
    check_no_links(folder)
    try:
        rec = read_record(folder / MARKER, kind="checkpoint-complete", run_id=run_id)
    except NotThereYet:
        return False
    except WrongRun as exc:
        raise _other_run(folder, exc) from None
    owner = Stamp(rec.run_id, int(rec.data["iteration"]))
    for rel, size in rec.data.get("files", {}).items():
        try:
            fd, st = open_listed(folder, rel, owner)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            if st.st_size != size:
                return False
            if rel.endswith(".safetensors"):
                check_stamp(fd, folder / rel, folder, owner)
        finally:
            os.close(fd)
    return True


# What to do about a damaged checkpoint of a run: baton never rewrites a published checkpoint and
# `recover` neither repairs one nor moves LATEST back (later iterations were decided on it).
UNREPAIRABLE = ("restore it from a copy, or start a new run (another --log-path) with model.path set to the "
                "last good checkpoint of this one (its optimizer state then starts afresh)")


def stamp_of(folder: Path) -> Stamp | None:
    """The run and iteration every safetensors file of checkpoint `folder` must carry (its
    marker's) when a loader reads it. None outside the run folders this process works in: a base
    model (`model.path`: any model, an SFT output, another run's checkpoint) is the user's, may
    carry no stamp or another's, and may be links (the Hugging Face cache). None too without a
    marker: no checkpoint; callers that load one of this run check `is_complete` first."""
    folder = Path(folder)
    if not in_run_folder(folder):
        return None
    try:
        rec = read_record(folder / MARKER, kind="checkpoint-complete")
    except Missing:
        return None
    except NotThereYet as exc:
        raise CheckpointError(f"{exc}: the checkpoint's completeness marker is damaged; {UNREPAIRABLE}") from None
    return Stamp(rec.run_id, int(rec.data["iteration"]))


def serving_weights(folder: Path) -> tuple[Path, Path | None]:
    """What an inference engine serves for checkpoint (or model) `folder`: (full weights folder,
    LoRA adapter folder or None). A checkpoint published with train.lora.publish=adapters has no
    full weights: it is the frozen base model its trainer_state.json names (`lora.base`) plus its
    `adapter/`. Any other folder is served as it is (with lora.publish=merged its `adapter/` is
    already merged into the weights); the engine checks that it holds a model."""
    folder = Path(folder)
    if (folder / "config.json").exists() or not (folder / TRAINER_STATE).exists():
        return folder, None
    try:
        lora = read_record(folder / TRAINER_STATE, kind="trainer-state").data.get("lora") or {}
    except NotThereYet as exc:
        raise CheckpointError(f"{folder / TRAINER_STATE} is damaged ({exc}), and {folder} has no full weights "
                              f"(config.json): it cannot be served; {UNREPAIRABLE}") from None
    if not lora.get("base"):
        raise CheckpointError(f"{folder} has neither full weights (config.json) nor LoRA adapters with a base model "
                              f"(lora.base in {TRAINER_STATE}); it cannot be served")
    base, adapter = Path(lora["base"]), folder / ADAPTER_DIR
    if not (base / "config.json").exists():
        raise CheckpointError(f"the LoRA adapters in {adapter} were trained on the base model {base}, which is gone; "
                              f"restore it at that path to serve them")
    return base, adapter


def read_latest(layout: RunLayout, *, run_id: str | None = None) -> tuple[int, Path] | None:
    """(iteration, folder) that LATEST names, or None before the first publication. With `run_id`,
    a LATEST of another run raises CheckpointError naming both ids."""
    try:
        rec = try_read(layout.latest, kind="latest", run_id=run_id)
    except WrongRun as exc:
        raise _other_run(layout.latest, exc) from None
    if rec is None:
        return None
    iteration = int(rec.data["iteration"])
    return iteration, layout.checkpoint(iteration)


def _move_latest(layout: RunLayout, iteration: int, run_id: str) -> None:
    current = read_latest(layout, run_id=run_id)
    if current is not None and current[0] >= iteration:
        return  # never backwards: a late publication of an old iteration must not undo a newer one
    publish_record(layout.latest, "latest", {"iteration": iteration, "path": layout.checkpoint(iteration).name},
                   run_id=run_id, generation=0)


def publish_checkpoint(layout: RunLayout, iteration: int, staging: Path, *, run_id: str) -> Path:
    """Rename the complete folder `staging` to `checkpoints/iter-N`, then move LATEST forward.

    Idempotent: when iter-N is already complete (an earlier call succeeded) only LATEST is
    brought up to date and a leftover staging folder is removed."""
    final = layout.checkpoint(iteration)
    staging = Path(staging)
    check_no_links(staging)
    if os.path.lexists(final):
        if not is_complete(final, run_id=run_id):
            raise CheckpointError(
                f"{final} exists but is not a complete checkpoint (baton only renames complete folders into "
                f"place, so something else wrote it); move it away and rerun the training phase")
        if staging.exists() and staging.resolve() != final.resolve():
            remove_tree(staging, ignore_errors=True)
    else:
        if not is_complete(staging, run_id=run_id):
            raise CheckpointError(
                f"staging folder {staging} is missing or incomplete ({MARKER} absent or files differ); "
                f"the training attempt did not finish: rerun it")
        ensure_dir(final.parent)
        fence_check()  # docs/design.md §5 rule 7: a superseded master renames nothing into place
        os.rename(staging, final)
    _move_latest(layout, iteration, run_id)
    return final


def optimizer_pending(folder: Path, *, run_id: str | None = None) -> bool:
    """True for a checkpoint whose optimizer state was to follow its weights (a resident trainer
    writes it while the next iteration rolls out, docs/design.md §9.6) and is not complete in
    `folder/optimizer/` yet: if its writer died, the state must be made again (the redo rule)."""
    try:
        state = read_record(Path(folder) / TRAINER_STATE, kind="trainer-state", run_id=run_id).data
    except NotThereYet:
        return False
    return bool(state.get("optimizer_deferred")) and not is_complete(Path(folder) / OPTIMIZER_DIR, run_id=run_id)


def publish_optimizer(layout: RunLayout, iteration: int, staging: Path, *, run_id: str) -> Path:
    """Rename the complete optimizer folder `staging` to `checkpoints/iter-N/optimizer`, once
    iter-N itself is published. Idempotent: an optimizer folder already complete there is kept and
    the staging folder removed."""
    final = layout.checkpoint(iteration) / OPTIMIZER_DIR
    staging = Path(staging)
    check_no_links(staging)
    if not is_complete(layout.checkpoint(iteration), run_id=run_id):
        raise CheckpointError(f"{layout.checkpoint(iteration)} is not a published checkpoint; its optimizer state "
                              f"in {staging} cannot go into it")
    if is_complete(final, run_id=run_id):
        remove_tree(staging, ignore_errors=True)
        return final
    if not is_complete(staging, run_id=run_id):
        raise CheckpointError(f"optimizer staging folder {staging} is missing or incomplete; the trainer that "
                              f"wrote it did not finish: the next training replays iteration {iteration}")
    if os.path.lexists(final):
        remove_tree(final)  # an incomplete optimizer/ (never written by baton's rename): replace it
    fence_check()  # docs/design.md §5 rule 7
    os.rename(staging, final)
    return final


def published_iterations(layout: RunLayout) -> list[int]:
    """Iterations that have a folder under checkpoints/ (a directory listing: call rarely)."""
    try:
        check_no_links(layout.checkpoints_dir)
        names = [p.name for p in layout.checkpoints_dir.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(n for n in (iteration_number(name) for name in names) if n is not None)


def apply_retention(layout: RunLayout, *, keep_last: int, protected: set[int]) -> list[int]:
    """Remove old checkpoints except the last `keep_last`, the `protected` iterations (eval
    iterations, the one being served) and LATEST's. Returns the iterations removed.

    A checkpoint is first renamed into checkpoints/.trash (so it disappears in one step) and
    then deleted. Staging folders of iterations LATEST has passed are dead attempts and go too."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1 (got {keep_last})")
    fence_check()  # removing is writing: a superseded master keeps its hands off (docs/design.md §5 rule 7)
    latest = read_latest(layout)
    latest_iter = latest[0] if latest else None
    present = published_iterations(layout)
    keep = set(present[-keep_last:]) | set(protected)
    if latest_iter is not None:
        keep.add(latest_iter)
    # The newest checkpoint whose optimizer state is on disk stays: while a newer one's state is
    # still being written, a crash makes the trainer replay that newer iteration from it.
    durable = next((i for i in reversed(present) if not optimizer_pending(layout.checkpoint(i))), None)
    if durable is not None:
        keep.add(durable)
    removed = []
    for iteration in present:
        if iteration in keep or (latest_iter is not None and iteration > latest_iter):
            continue
        check_no_links(layout.checkpoint(iteration))
        ensure_dir(layout.checkpoint_trash_dir)
        trash = layout.checkpoint_trash(iteration, os.getpid())
        os.rename(layout.checkpoint(iteration), trash)
        remove_tree(trash, ignore_errors=True)
        removed.append(iteration)
    # Never list a linked .staging (its entries would be another folder's); delete only names
    # that baton gives staging folders (`iter-N.aK`), each through remove_tree.
    staging_dir = layout.checkpoint_staging_dir
    check_no_links(staging_dir)
    if latest_iter is not None and staging_dir.exists():
        for path in staging_dir.iterdir():
            ident = staging_identity(path.name)
            if ident is not None and ident[0] <= latest_iter:
                remove_tree(path, ignore_errors=True)
            ident = optimizer_staging_identity(path.name)
            # optimizer state of an iteration no newer than the newest one whose state is in place:
            # moved there already, or left by a writer that died (the replay wrote its own)
            if ident is not None and durable is not None and ident[0] <= durable:
                remove_tree(path, ignore_errors=True)
    if removed:
        _log.info("retention removed checkpoints %s (keeping %s)", removed, sorted(keep & set(present)))
    return removed
