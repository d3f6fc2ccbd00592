"""Atomic publication and validated reading of files on a shared filesystem (docs/design.md §5 rules 1-3).

Writers never expose a half-written file: they write a uniquely named temp file in the target's
directory, fsync it, check `close`, and `os.replace` it over the target (never deleting the
target first, never keeping the published file open). Exclusive creations (claims, GO, run.json)
use O_EXCL and write the whole record in one call.

JSON records carry a small envelope: format, kind, run_id, generation, wall time and a CRC of
their canonical content, so a reader can tell "not there yet / half-written" (retry) from "there"
and from "another run's file" (a different run_id).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import socket
import stat
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from coordination import fsops
from coordination.exhaustion import name_file
from coordination.layout import LinkInRunFolder, check_no_links, forget_verified, hard_link_refused, in_run_folder

FORMAT = "baton/1"

# Files are group-readable, never world-writable (protocol rule 11).
FILE_MODE = 0o640
DIR_MODE = 0o750
# Set by every entrypoint that writes (`restrict_umask`), so files that libraries create with
# their own modes (Hugging Face save_pretrained, Parquet, torchrun's children) are no wider.
UMASK = 0o027

_HOST = socket.gethostname()


class RecordError(Exception):
    """A record that cannot be used."""


class NotThereYet(RecordError):
    """Missing, empty, half-written or failing its checksum: retry later."""


class Missing(NotThereYet):
    """The file does not exist (yet)."""


class WrongRun(RecordError):
    """A well-formed record that belongs to another run (different run_id)."""


class BrokenRecord(RecordError):
    """A record that stayed unreadable for longer than the caller's bound."""


class Fenced(RuntimeError):
    """This process's claim was superseded by a newer generation; it must stop writing and exit."""


# -- the fence guard (docs/design.md §5 rule 7) -------------------------------------------------
# Readers ignore a superseded generation's output, but a paused process that wakes up must not
# even put files in place: a chunk renamed over a name the new generation reads, or a timeline
# line, would be its last word in a run it no longer belongs to. So every writer in this module
# (and timeline.append, the checkpoint renames, garbage collection) asks `fence_check()` right
# before the step that makes its output visible. The guard is process-wide: `Node.join` installs
# it, and children (torchrun's trainers, servers) inherit the claim file to watch through
# ENV_FENCE, so their writes through these helpers are fenced as well.
ENV_FENCE = "BATON_FENCE_FILE"


class FenceGuard:
    """Fenced once `newer_claim` (claim-(G+1) of this process's rank) exists or `flag()` says so.

    Sticky: once noticed it stays noticed and `on_fenced` runs once. One stat per `check`."""

    def __init__(self, newer_claim: Path, *, flag: Callable[[], bool] | None = None,
                 on_fenced: Callable[[], None] | None = None, explain: Callable[[], str] | None = None):
        self.newer_claim = Path(newer_claim)
        self.flag = flag
        self.on_fenced = on_fenced
        self.explain = explain
        self.noticed = False
        self._probed = float("-inf")

    def fenced(self, max_age: float = 0.0) -> bool:
        """True once this process is superseded. Stats the newer claim unless the last stat is
        younger than `max_age` seconds (for callers as frequent as log lines)."""
        if self.noticed:
            return True
        now = time.monotonic()
        if (self.flag is not None and self.flag()) or (
                now - self._probed >= max_age and self._probe(now)):
            self.noticed = True
            if self.on_fenced is not None:
                self.on_fenced()
        return self.noticed

    # A process stopped (SIGSTOP, a frozen VM) while its probe's stat is in flight stops when the
    # stat returns, so on waking it would act on an answer from before the pause. A probe that took
    # this long is therefore asked again; a filesystem that slow is asked at most PROBE_TRIES times.
    PAUSED_PROBE = 0.5
    PROBE_TRIES = 5

    def _probe(self, now: float) -> bool:
        for _ in range(self.PROBE_TRIES):
            start = time.monotonic()
            found = fsops.exists(self.newer_claim)
            self._probed = time.monotonic()
            if found or self._probed - start < self.PAUSED_PROBE:
                return found
        return False

    def check(self) -> None:
        if self.fenced():
            raise Fenced(self.explain() if self.explain is not None else
                         f"{self.newer_claim} exists: the rank this process worked for was taken over by a newer "
                         f"generation; this process writes nothing further")


_guard: FenceGuard | None = None


def install_fence(guard: FenceGuard | None) -> None:
    """Make `guard` this process's fence (None removes it) and let children inherit its claim file."""
    global _guard
    _guard = guard
    if guard is None:
        os.environ.pop(ENV_FENCE, None)
    else:
        os.environ[ENV_FENCE] = str(guard.newer_claim)


def _current_guard() -> FenceGuard | None:
    global _guard
    if _guard is None and os.environ.get(ENV_FENCE):
        _guard = FenceGuard(Path(os.environ[ENV_FENCE]))  # a child of a node: watch its claim file
    return _guard


def fence_check() -> None:
    """Raise Fenced if this process has been superseded (one stat). Writers call it right before
    they rename, create or append under the log path."""
    guard = _current_guard()
    if guard is not None:
        guard.check()


def _fence_precheck() -> None:
    """Before a temp file is created: a fence already known refuses at once, and a stat older than a
    second (a process that was paused, above all) is taken again, so a woken process does not even
    create and remove a temp file. Costs at most one stat a second; the check before the rename
    stays the one that counts."""
    guard = _current_guard()
    if guard is not None and guard.fenced(max_age=1.0):
        guard.check()


def fence_noticed(max_age: float = 1.0) -> bool:
    """Whether this process is fenced, probing at most once per `max_age` seconds (log handlers)."""
    guard = _current_guard()
    return guard is not None and guard.fenced(max_age)


@dataclass(frozen=True)
class Record:
    kind: str
    run_id: str
    generation: int
    data: dict[str, Any]
    wall_time: float
    path: Path = field(compare=False)


def restrict_umask() -> None:
    """Make everything this process and its children create at most 0o750 / 0o640, whatever the
    user's umask (docs/design.md §5 rule 11). Call first thing in an entrypoint that writes."""
    os.umask(UMASK)


def ensure_dir(path: Path) -> Path:
    """mkdir -p with the project's permissions (no world access) on every folder it creates.

    `Path.mkdir(parents=True)` gives the mode only to the last folder (the parents get
    0o777 minus the umask), so missing parents are made one by one. Refuses a link on the way
    inside a run folder (`layout.check_no_links`)."""
    path = Path(path)
    check_no_links(path)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileNotFoundError:
        ensure_dir(path.parent)
        try:
            path.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass  # another process made it between our two calls
    except FileExistsError:
        if not path.is_dir():
            raise NotADirectoryError(f"{path} exists and is not a folder; move it away") from None
    return path


def own_opener(path: str, flags: int) -> int:
    """`opener=` for `open()` on a file baton owns under a run folder: never through a link
    (O_NOFOLLOW on the file, `check_no_links` on its folders), created with FILE_MODE.

    A writer checks the folders before it opens. A reader checks them once the file opened
    (before a byte is read), so polling for a file that does not exist yet costs nothing more
    than the open itself (docs/design.md §5 rule 5).

    A writer also refuses a file with more than one name (a hard link, or every file of a
    `cp -al` copy of a run): appending to it or overwriting it in place would change the file
    under its other names too. O_TRUNC is therefore applied only after that check."""
    parent = os.path.dirname(os.path.abspath(path))  # plain strings: this runs on every barrier poll
    writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
    inside = check_no_links(parent) if writing else in_run_folder(parent)
    truncate = bool(inside and writing and flags & os.O_TRUNC)
    if inside:
        flags |= os.O_NOFOLLOW
    if truncate:
        flags &= ~os.O_TRUNC
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP and stat.S_ISLNK(os.lstat(path).st_mode):
            raise LinkInRunFolder(
                f"{path} is a symbolic link (to {os.readlink(path)}) where baton keeps its own file; baton "
                f"refuses to write or read through it. Remove the link (`rm {path}`) and start again") from None
        raise
    if inside and writing:
        try:
            names = os.fstat(fd).st_nlink
            if names > 1:
                raise hard_link_refused(path, names)
            if truncate:
                os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
    if inside and not writing:
        try:
            check_no_links(parent)
        except BaseException:
            os.close(fd)
            raise
    return fd


def open_own(path: Path, mode: str = "rb", **kw: Any):
    """`open()` of a file baton owns (a log, a timeline): see `own_opener`."""
    if any(c in mode for c in "wax+"):
        ensure_dir(Path(path).parent)
    return open(path, mode, opener=own_opener, **kw)


def remove_tree(path: Path, *, ignore_errors: bool = False) -> None:
    """Delete a folder (or file) baton made, never through a link: a link at `path` or on the way
    to it inside the run folder is refused (`layout.check_no_links`), and `shutil.rmtree` does not
    follow links inside the tree (it unlinks them)."""
    path = Path(path)
    check_no_links(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):  # outside every run folder: still never follow it
        raise LinkInRunFolder(f"{path} is a symbolic link where baton expects its own folder; remove the link by hand")
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=ignore_errors)
    else:
        os.unlink(path)
    forget_verified(path)


def _temp_name(target: Path) -> Path:
    # Unique per host, pid and call, in the target's own directory so os.replace stays atomic.
    return target.with_name(f".{target.name}.tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    """True for the temp files `atomic_output` leaves behind when its writer dies."""
    return name.startswith(".") and ".tmp-" in name


def temp_writer(name: str) -> tuple[str, int] | None:
    """(host, pid) of the process that made temp file `name` (`_temp_name`), None if it is none."""
    if not is_temp_name(name):
        return None
    host, _, pid = name.rpartition(".tmp-")[2].rpartition("-")[0].rpartition("-")
    return (host, int(pid)) if host and pid.isdigit() else None


@contextlib.contextmanager
def atomic_output(target: Path) -> Iterator[Path]:
    """Yield a temp path; on success fsync it and rename it onto `target` in one step.

    Use for files written by libraries that want a path (Parquet, safetensors)."""
    target = Path(target)
    _fence_precheck()
    ensure_dir(target.parent)
    tmp = _temp_name(target)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, FILE_MODE)
        fence_check()
        os.replace(tmp, target)
    except Fenced:
        raise  # the temp file stays for `recover`: a superseded process removes nothing either
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        name_file(exc, target)  # os.write and pyarrow name no file
        raise


def publish_bytes(target: Path, data: bytes, *, durable: bool = True) -> None:
    """Atomically replace `target` with `data`.

    `durable=False` skips the fsync, for files that are rewritten every few seconds and worth
    nothing after a power loss (heartbeats); the rename keeps them atomic for readers."""
    target = Path(target)
    _fence_precheck()
    fsops.count("publish", 2)  # create + rename
    check_no_links(target.parent)  # cached per folder: no extra operation once seen
    tmp = _temp_name(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileNotFoundError:
        ensure_dir(target.parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        try:
            _write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)  # raises on a failed close (NFS reports write errors here)
        fence_check()
        os.replace(tmp, target)
    except Fenced:
        raise  # the temp file stays for `recover`: a superseded process removes nothing either
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        name_file(exc, target)  # os.write and pyarrow name no file
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _checksum(kind: str, run_id: str, generation: int, data: Any) -> str:
    canon = json.dumps([kind, run_id, generation, data], sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(canon.encode()):08x}"


def encode_record(kind: str, data: dict[str, Any], *, run_id: str, generation: int) -> bytes:
    envelope = {
        "format": FORMAT,
        "kind": kind,
        "run_id": run_id,
        "generation": int(generation),
        "wall_time": time.time(),
        "data": data,
        "crc": _checksum(kind, run_id, int(generation), data),
    }
    return (json.dumps(envelope, sort_keys=True, indent=1) + "\n").encode()


def publish_record(target: Path, kind: str, data: dict[str, Any], *, run_id: str, generation: int,
                   durable: bool = True) -> None:
    """Atomically publish a JSON record (replaces an older version of the same record)."""
    publish_bytes(target, encode_record(kind, data, run_id=run_id, generation=generation), durable=durable)


def create_record(target: Path, kind: str, data: dict[str, Any], *, run_id: str, generation: int) -> bool:
    """Create `target` exclusively (O_EXCL). True if this call created it, False if it existed.

    The whole record goes out in one write; a reader that catches the tiny window before it
    lands sees an empty or short file, which `read_record` reports as NotThereYet.

    On sshfs the loser of a true race gets EPERM, not EEXIST: the server's EEXIST crosses SFTP as
    the generic SSH_FX_FAILURE, which sshfs reports as EPERM (docs/design.md §10.1). EPERM while
    the name exists is therefore a lost race; EPERM without it is a real permission error."""
    target = Path(target)
    fence_check()
    ensure_dir(target.parent)
    payload = encode_record(kind, data, run_id=run_id, generation=generation)
    fsops.count("create")
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        return False
    except PermissionError as exc:
        if exc.errno == errno.EPERM and os.path.lexists(target):
            return False
        raise
    try:
        _write_all(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def decode_record(raw: bytes, path: Path, *, kind: str | None = None, run_id: str | None = None) -> Record:
    if not raw:
        raise NotThereYet(f"{path}: empty (being written?)")
    try:
        env = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NotThereYet(f"{path}: not valid JSON yet ({exc.msg if hasattr(exc, 'msg') else exc})") from None
    if not isinstance(env, dict) or env.get("format") != FORMAT:
        raise NotThereYet(f"{path}: not a {FORMAT} record")
    try:
        rkind, rrun, rgen, data, crc = env["kind"], env["run_id"], env["generation"], env["data"], env["crc"]
    except KeyError as exc:
        raise NotThereYet(f"{path}: record lacks {exc.args[0]!r}") from None
    if crc != _checksum(rkind, rrun, rgen, data):
        raise NotThereYet(f"{path}: checksum mismatch (truncated or altered)")
    if kind is not None and rkind != kind:
        raise NotThereYet(f"{path}: expected a {kind!r} record, found {rkind!r}")
    if run_id is not None and rrun != run_id:
        raise WrongRun(f"{path}: belongs to run {rrun}, not to this run {run_id}")
    return Record(rkind, rrun, int(rgen), data, float(env.get("wall_time", 0.0)), Path(path))


def read_record(path: Path, *, kind: str | None = None, run_id: str | None = None) -> Record:
    """Read and validate one record. Raises NotThereYet for anything a retry may fix.

    ESTALE (NFS: the file was replaced under an open handle) counts as "not there yet"."""
    fsops.count("open")
    try:
        with open(path, "rb", opener=own_opener) as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise Missing(f"{path}: does not exist") from None
    except OSError as exc:
        if exc.errno in (errno.ESTALE, errno.EIO, errno.EAGAIN):
            raise NotThereYet(f"{path}: transient read error ({os.strerror(exc.errno)})") from None
        raise
    return decode_record(raw, Path(path), kind=kind, run_id=run_id)


def try_read(path: Path, *, kind: str | None = None, run_id: str | None = None) -> Record | None:
    """`read_record`, but None for anything not there yet (wrong-run records still raise)."""
    try:
        return read_record(path, kind=kind, run_id=run_id)
    except NotThereYet:
        return None


def read_or_none(path: Path, *, kind: str | None = None, run_id: str | None = None) -> Record | None:
    """`read_record`, but None for anything that is not a whole record of this run: missing, half
    written, damaged or another run's. For readers that only show or probe what is there and try again
    later; those that must tell a foreign or broken record apart use `try_read` or `read_record`."""
    try:
        return read_record(path, kind=kind, run_id=run_id)
    except RecordError:
        return None


class PatientReader:
    """Reads records that may be half-written for a while, and reports those that stay broken.

    A file that exists but does not validate is retried; once it has stayed broken for
    `broken_after` seconds (on `clock`), `read` raises BrokenRecord naming the file and the
    last problem. A missing file is simply "not there yet" and never broken. A valid record of
    another run raises WrongRun at once: no retry turns it into ours."""

    def __init__(self, broken_after: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.broken_after = broken_after
        self.clock = clock
        self._broken_since: dict[Path, float] = {}

    def read(self, path: Path, *, kind: str | None = None, run_id: str | None = None) -> Record | None:
        path = Path(path)
        try:
            rec = read_record(path, kind=kind, run_id=run_id)
        except Missing:
            self._broken_since.pop(path, None)
            return None
        except NotThereYet as exc:
            since = self._broken_since.setdefault(path, self.clock())
            if self.clock() - since > self.broken_after:
                raise BrokenRecord(
                    f"{exc} -- it has stayed unusable for more than {self.broken_after:.0f} s; inspect it. A "
                    f"barrier's record (under sync/iter-N/) is removed with `scripts/recover.sh --reset-phase "
                    f"ITER:PHASE`, which makes that phase run again") from None
            return None
        self._broken_since.pop(path, None)
        return rec
