"""Resource exhaustion is a stop, not a crash (docs/design.md §9.1): a full disk (ENOSPC), a quota
(EDQUOT), a read-only filesystem (EROFS) or the open-file limit (EMFILE, ENFILE) end the node with
exit code 8 and one line naming the path, the errno and what to free. Nothing is retried: the next
write would fail the same way, and the node resumes where it stopped once it is restarted.

`of(exc)` finds such a cause in an exception, in its chain (`raise ... from`, or an error raised
while handling another), or in the text a child reported (a trainer's result record, the lines of
its log: "No space left on device (os error 28)" from safetensors' Rust, "[errno 28]" from
pyarrow, "[Errno 28] ...: '/path'" from Python).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

RESTART = "then restart this node with the same command to resume (nothing published is lost)"


@dataclass(frozen=True)
class Shortage:
    what: str      # what ran out, as a person says it
    verb: str      # what the node was doing to the path
    todo: str      # what to free; may name {folder}, the folder of the path

    def advice(self, folder: str) -> str:
        return self.todo.format(folder=folder, nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0])


SHORTAGES: dict[int, Shortage] = {
    errno.ENOSPC: Shortage("no space left on device", "writing",
                           "free space on the filesystem that holds {folder} (`df -h {folder}`; old runs, "
                           "checkpoints of other runs) or move the run to a larger one"),
    errno.EDQUOT: Shortage("disk quota exceeded", "writing",
                           "free space within your quota on the filesystem that holds {folder} (`quota -s`, "
                           "`du -sh {folder}`) or ask for a larger quota"),
    errno.EROFS: Shortage("read-only filesystem", "writing",
                          "remount the filesystem that holds {folder} read-write, or move the run to a "
                          "writable one"),
    errno.EMFILE: Shortage("too many open files in this process", "opening",
                           "raise the open-file limit of the shell that starts the node (`ulimit -n`, now "
                           "{nofile}) or close what holds files open in it"),
    errno.ENFILE: Shortage("too many open files on this machine", "opening",
                           "close files that other processes on this machine hold open, or raise the "
                           "system's limit (`sysctl fs.file-max`)"),
}

# A child's words for the same errors. ENFILE's text contains EMFILE's: it is tried first.
_TEXTS = sorted(((os.strerror(e), e) for e in SHORTAGES), key=lambda t: -len(t[0]))
_PATH_AFTER = r":? *'(/[^'\n]+)'"


class ResourceExhausted(RuntimeError):
    """This node ran out of a resource a person must free; the message says which and how."""

    def __init__(self, err: int, path: str | os.PathLike | None, where: str | os.PathLike | None = None):
        self.errno, self.shortage = err, SHORTAGES[err]
        self.path = str(path) if path else None
        place = Path(self.path or where or ".")
        at = f"{self.shortage.verb} {place}" if self.path else f"{self.shortage.verb} under {place}"
        super().__init__(f"{self.shortage.what} ({errno.errorcode[err]}, errno {err}) {at}: "
                         f"{self.shortage.advice(str(_existing_folder(place)))}, {RESTART}")


def _existing_folder(path: Path) -> Path:
    """The folder to point `df` at: the nearest one that exists (a temp file or a staging folder
    may be gone by the time the message is read)."""
    folder = path.parent if not path.is_dir() else path
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    return folder


def name_file(exc: BaseException, path: str | os.PathLike) -> None:
    """Name `path` in an OSError that names no file (os.write, a file object's write, pyarrow), so
    the line a node stops with says where it was writing."""
    if isinstance(exc, OSError) and exc.filename is None:
        exc.filename = str(path)


@contextlib.contextmanager
def naming(path: str | os.PathLike):
    """`name_file` for what the block raises: around writes through an open file object."""
    try:
        yield
    except OSError as exc:
        name_file(exc, path)
        raise


def of(exc: BaseException | None, where: str | os.PathLike | None = None) -> ResourceExhausted | None:
    """The resource `exc` (or an exception it was raised from or while handling) ran out of, or
    None. `where` names the folder when the error names no path (os.write, pyarrow)."""
    from coordination.procgroup import ChildFailed  # imported late: procgroup imports this module

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ResourceExhausted):
            return exc
        if isinstance(exc, OSError) and exc.errno in SHORTAGES:
            return ResourceExhausted(exc.errno, exc.filename, where)
        if isinstance(exc, ChildFailed):
            found = in_text(str(exc), where)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def in_text(text: str, where: str | os.PathLike | None = None) -> ResourceExhausted | None:
    """The first shortage a child's error text names (with the path after it, when it gives one)."""
    for words, err in _TEXTS:
        m = re.search(re.escape(words) + f"(?:{_PATH_AFTER})?", text, re.IGNORECASE)
        if m is not None:
            return ResourceExhausted(err, m.group(1), where)
    return None
