"""Exit codes of baton processes, distinct so scripts and people can tell why a node stopped."""
from __future__ import annotations

from coordination import exhaustion
from coordination.claims import ClaimRefused, Fenced
from coordination.config import ConfigError
from coordination.layout import LinkInRunFolder
from coordination.manifest import JoinRefused, UnusableLogPath
from coordination.node import PeerLost
from coordination.records import BrokenRecord
from coordination.runner import PhaseFailed

OK = 0            # finished, or stopped on request / at max_iterations
ERROR = 1         # an unexpected error (a bug, or an environment problem the message names)
USAGE = 2         # bad command line, config or input (task files, reward, an unwritable --log-path)
REFUSED = 3       # not allowed to join: config mismatch, duplicate live rank, unsafe log path
PEER_LOST = 4     # a peer stayed lost past coordination.rejoin_timeout
FENCED = 5        # this process was superseded by a newer generation of its rank
ABORTED = 6       # the master's decision after a failed phase
BROKEN = 7        # a shared file stayed unreadable past coordination.broken_record_timeout
RESOURCE = 8      # out of disk space, quota or open files, or a read-only filesystem (coordination.exhaustion)


def classify(exc: BaseException) -> int:
    """The exit code for an exception that ends a node."""
    table = ((ConfigError, USAGE), (UnusableLogPath, USAGE), (JoinRefused, REFUSED), (ClaimRefused, REFUSED),
             (LinkInRunFolder, REFUSED), (PeerLost, PEER_LOST),
             (Fenced, FENCED), (PhaseFailed, ABORTED), (BrokenRecord, BROKEN))
    for cls, code in table:
        if isinstance(exc, cls):
            return code
    # After the table: a refusal at join already names a full or read-only log path (exit 2).
    if exhaustion.of(exc) is not None:
        return RESOURCE
    return ERROR


def message(exc: BaseException, where: str | None = None) -> str:
    """The one line that ends a node: for exhaustion the shortage, its path and what to free (the
    error itself often names no path, hence `where`, the run folder), else the exception's text."""
    found = exhaustion.of(exc, where) if classify(exc) == RESOURCE else None
    return str(found) if found is not None else str(exc)
