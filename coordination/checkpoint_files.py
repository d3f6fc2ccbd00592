"""The files inside a checkpoint folder: whose they are, and opening them without links (docs/design.md §11.4).

A completeness marker lists sizes, which say that a file is whole, not whose it is: a symbolic
link to another run's `model.safetensors`, a hard link to it, or a copy of the same size passes a
size check. So every file a marker lists is opened with O_NOFOLLOW and refused when another name
shares its inode (st_nlink > 1: a write to either changes both), and every safetensors file a
checkpoint holds (weights, optimizer shards, adapters) carries the run and iteration that wrote it
in its header's metadata (`baton.run_id`, `baton.iteration`, beside the `"format": "pt"` that
transformers and vLLM read; the metadata is free-form str -> str and both ignore the rest). A
reader compares that stamp with the marker's: one header read per file, nothing hashed, so the
load path costs what it cost before.

SFTP (version 3) carries no link count, so on sshfs the stamp alone tells another run's
hard-linked file apart; a hard link to this run's own file of the same iteration is harmless to
read but is still refused where the count is visible, because a write through the other name
would change it.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

RUN_KEY = "baton.run_id"
ITERATION_KEY = "baton.iteration"
# safetensors itself refuses headers above 100 MB; a larger length means the file is something else.
_MAX_HEADER = 100_000_000


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be published or used; the message says what to do."""


@dataclass(frozen=True)
class Stamp:
    """The run and iteration a checkpoint file belongs to."""
    run_id: str
    iteration: int

    def metadata(self) -> dict[str, str]:
        return {RUN_KEY: self.run_id, ITERATION_KEY: str(self.iteration)}

    def __str__(self) -> str:
        return f"run {self.run_id}, iteration {self.iteration}"


def _fix(folder: Path) -> str:
    # Moving a folder away retrains its iteration only while LATEST has not reached it: the driver
    # needs LATEST's checkpoint and nothing moves LATEST back.
    return (f"put this run's own file back, or move {folder} out of the run folder and restart (that trains an "
            f"iteration newer than LATEST again; for the checkpoint LATEST names, start a new run with model.path "
            f"set to the newest checkpoint you trust)")


def safetensors_header(fd: int, path: Path | str = "the file") -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, plus `__metadata__`; byte offset of the data)
    of an open safetensors file."""
    head = os.pread(fd, 8, 0)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    if not 0 < n <= _MAX_HEADER:
        raise CheckpointError(f"{path} is not a safetensors file (no valid header); restore it from the run that "
                              f"wrote it or remove its checkpoint")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a damaged safetensors header; restore it from the run that wrote it or "
                              f"remove its checkpoint")
    return header, 8 + n


def stamp_of_file(fd: int, path: Path | str) -> Stamp | None:
    """The stamp in an open safetensors file's metadata, or None when it carries none."""
    meta = safetensors_header(fd, path)[0].get("__metadata__") or {}
    run, it = meta.get(RUN_KEY), meta.get(ITERATION_KEY)
    if not isinstance(run, str) or not isinstance(it, str) or not it.isdigit():
        return None
    return Stamp(run, int(it))


def _carries(fd: int, path: Path) -> str:
    try:
        found = stamp_of_file(fd, path)
    except CheckpointError:
        return "it is not a safetensors file baton wrote"
    return f"it carries {found}" if found is not None else "it carries no baton run id"


def open_listed(folder: Path, rel: str, owner: Stamp) -> tuple[int, os.stat_result]:
    """(read-only fd, its fstat) of `folder/rel`, a file the marker of `owner`'s checkpoint `folder`
    lists: never through a symbolic link (on the file or a folder below `folder`), never a file that
    has another name. FileNotFoundError when it is missing (the caller decides what that means)."""
    path, cur = Path(folder) / rel, Path(folder)
    for part in Path(rel).parts[:-1]:
        cur = cur / part
        if cur.is_symlink():
            raise CheckpointError(f"{cur} is a symbolic link (to {os.readlink(cur)}) in the checkpoint of {owner}; "
                                  f"baton never links checkpoint folders: {_fix(folder)}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP and stat.S_ISLNK(os.lstat(path).st_mode):
            raise CheckpointError(
                f"{path} is a symbolic link (to {os.readlink(path)}) in the checkpoint of {owner}; baton never links "
                f"checkpoint files and never loads weights through a link, which may be another run's: "
                f"{_fix(folder)}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file, yet the checkpoint of {owner} lists it as one: "
                                  f"{_fix(folder)}")
        if st.st_nlink > 1:
            carried = _carries(fd, path) if path.suffix == ".safetensors" else "its other names are unknown"
            raise CheckpointError(
                f"{path} has {st.st_nlink} names (hard links; {carried}) in the checkpoint of {owner}; baton refuses a "
                f"shared file, which may be another run's or change through the other name: {_fix(folder)}, or, if "
                f"a copy made with `cp -al` shares this run's own file, give it its own copy "
                f"(`cp -p {path} {path}.own && mv {path}.own {path}`)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_stamp(fd: int, path: Path, folder: Path, owner: Stamp) -> None:
    """Refuse the open safetensors file `path` unless it carries `owner`'s stamp."""
    found = stamp_of_file(fd, path)
    if found == owner:
        return
    whose = f"belongs to {found}" if found is not None else "carries no baton run id (it was not written by this run)"
    raise CheckpointError(f"{path} {whose}, but the checkpoint that lists it is {owner}: it was copied or linked "
                          f"here, and baton never loads another run's weights or optimizer state as this run's: "
                          f"{_fix(folder)}")


def stamped(data: bytes | memoryview, stamp: Stamp) -> tuple[bytes, memoryview]:
    """For writers whose library fixes the metadata (DCP, peft): the serialized safetensors `data`
    as (a new header carrying `stamp`, the unchanged tensor bytes). The data offsets in a header
    are relative to the end of the header, so only the header changes; it is padded with spaces
    to a multiple of 8 bytes, as safetensors pads its own."""
    view = memoryview(data)
    n = struct.unpack("<Q", view[:8])[0] if len(view) >= 8 else 0
    if not 0 < n <= min(_MAX_HEADER, len(view) - 8):
        raise CheckpointError("the bytes to stamp are not a safetensors file; the library that wrote them changed "
                              "its format")
    header = json.loads(bytes(view[8:8 + n]))
    header["__metadata__"] = {**(header.get("__metadata__") or {}), **stamp.metadata()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, view[8 + n:]
