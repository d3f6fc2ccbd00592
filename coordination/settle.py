"""Reading a record another node has just created, on a mount that may still show it stale
(docs/design.md §5 rule 2, §10.1).

`run.json` and `job.json` are created with O_EXCL and written in one call. A mount that looked
the name up in between (a racing master, a worker) keeps what it saw, an empty file or no file,
for as long as its attribute and entry caches last: sshfs `attr_timeout`/`entry_timeout`, NFS
`acregmax` (60 s by default). Such a record is read again for up to the bound the config states
for unreadable records, `coordination.broken_record_timeout`; one still unreadable then is "not
yet visible on this mount (attribute cache)", a reason to retry, never a reason to throw a
healthy run away. Only bytes that cannot be (the start of) a baton record are called damaged,
and at once: no cache turns them into a record.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from coordination.clock import Backoff, Clock
from coordination.config import CoordinationConfig
from coordination.records import Missing, NotThereYet, Record, own_opener, read_record

log = logging.getLogger("baton.settle")

# The wait when a caller has no config at hand (tests, tools): the same default as the config's.
DEFAULT_SETTLE = CoordinationConfig().broken_record_timeout
KEY = "coordination.broken_record_timeout"


class NotVisibleYet(RuntimeError):
    """The record exists on the shared filesystem, but this mount has not shown its content
    within the settle bound."""


class DamagedRecord(RuntimeError):
    """What this mount shows cannot be a baton record, however long it is waited for."""


def cannot_be_a_record(raw: bytes) -> bool:
    """True when `raw` is neither what a stale cache shows of a freshly created record (nothing,
    zeros, a cut-off start of it) nor the record itself. A record is one JSON object, so a
    complete JSON document that failed validation is damage; so is anything not starting with
    '{'."""
    body = raw.replace(b"\0", b"").strip()
    if not body:
        return False
    try:
        json.loads(body)
    except ValueError:
        return not body.startswith(b"{")
    return True


def _shown_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb", opener=own_opener) as fh:
            return fh.read()
    except OSError:
        return b""  # gone or a transient error: nothing that proves damage


def read_settled(path: Path, *, kind: str, run_id: str | None = None, settle: float = DEFAULT_SETTLE,
                 exists: bool = False, clock: Clock | None = None) -> Record | None:
    """The record at `path`, waiting up to `settle` seconds for this mount to show it.

    None when the file does not exist, unless `exists` says the caller knows it does (it lost
    the exclusive create of that name): then a missing file is a cached negative lookup and is
    waited for too. NotVisibleYet once `settle` is over; DamagedRecord at once for bytes that
    cannot be a record; WrongRun (a valid record of another run) at once, as `read_record`."""
    clock = clock or Clock()
    backoff = Backoff(0.02, 0.5)
    deadline = None
    while True:
        try:
            return read_record(path, kind=kind, run_id=run_id)
        except Missing as exc:
            if not exists:
                return None
            last = exc
        except NotThereYet as exc:
            if cannot_be_a_record(_shown_bytes(path)):
                raise DamagedRecord(f"{path} is damaged: {exc}, and its bytes cannot be a baton {kind} "
                                    f"record") from None
            last = exc
        now = clock.monotonic()
        if deadline is None:
            deadline = now + settle
            log.info("%s exists but is not yet visible on this mount (%s); reading it again for up to %.0f s "
                     "(%s), as a mount's attribute cache can hide a file another node just created",
                     path, last, settle, KEY)
        if now >= deadline:
            raise NotVisibleYet(
                f"{path} exists but is not yet visible on this mount (attribute cache) after {settle:.0f} s "
                f"({last}). Retry in a minute; if this mount caches attributes longer (NFS acregmax, sshfs "
                f"attr_timeout), raise {KEY} above that")
        clock.sleep(backoff.next())
