"""Child processes a node starts (torchrun, servers): own process group, bounded stop, and a
watch on the peers while they run, so a dead node ends a collective instead of hanging it."""
from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path
from typing import Callable, Iterable

from coordination import log as blog
from coordination.diagnose import relevant_lines
from coordination.node import Node
from coordination.procgroup import ChildFailed, start_child
from coordination.stall import tick

log = logging.getLogger("baton.children")


def why(path: Path, offset: int = 0) -> str:
    """The lines of `path` after `offset` that say why a child failed (diagnose.relevant_lines),
    or its last lines when none does."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(relevant_lines(text) or text.splitlines()[-20:])


def run_watched(cmd: list[str], *, env: dict, log_file: Path, node: Node, peers: Iterable[int],
                what: str, check_every: float = 2.0, on_tick: Callable[[], None] | None = None) -> None:
    """Run `cmd` as a child (procgroup.start_child), output appended to `log_file`; while it runs,
    check this node's fence and the peers' heartbeats. A lost peer or a fence stops the child group."""
    node.check_fence()  # a superseded node neither starts a child nor touches its log
    peers = [r for r in peers if r != node.rank]
    child = start_child(cmd, env=env, log_file=log_file, what=what, start_timeout=node.cfg.child_start_timeout)
    try:
        while True:
            try:
                code = child.wait(timeout=check_every)
                break
            except subprocess.TimeoutExpired:
                pass
            check_node_and_peers(node, peers, what)
            if on_tick is not None:
                on_tick()
    finally:
        child.stop()
    if code != 0:
        raise exited(what, code, log_file, child.log_start)


def exited(what: str, code: int | None, log_file: Path, start: int = 0) -> ChildFailed:
    """The error for a child that exited with `code`: the cause its log names, and the log lines
    after offset `start` (this launch's part) that say why."""
    lines = why(log_file, start)
    cause = error_line(lines)
    return ChildFailed(f"{what} exited with code {code}{': ' + cause if cause else ''} (read {log_file}); "
                       f"from its log:\n{lines}")


def check_node_and_peers(node: Node, peers: Iterable[int], what: str) -> None:
    """While a child works for this node: raise Fenced if the node was taken over, ChildFailed if
    a peer (any rank but this one) is lost or gone, so the child is stopped instead of waiting in a
    collective until its timeout."""
    tick()  # one more round of a child's watch: the main thread is moving
    node.check_fence()
    blog.check()  # this node's log file was lost to a full disk: stop the child, stop the node
    for r in peers:
        if r == node.rank:
            continue
        view = node.peer_view(r)
        if view.lost or view.exited:
            raise ChildFailed(f"stopped {what}: rank {r} was {'lost' if view.lost else 'gone'} ({view.describe()})")


# Causes a person can act on come first: torchrun ends its log with its own generic
# ChildFailedError, which would otherwise hide the disk that filled up.
_ERROR_LINES = (re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|Permission denied"),
                re.compile(r"\b[A-Z]\w*(Error|Exception)\b|\bKilled\b"))


def error_line(text: str) -> str:
    """The last line of a child's log that names an error (`OSError: [Errno 28] No space left on
    device`), so the console shows the cause in one line, not only "exited with code 1"."""
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("File ", "Traceback", "raise ", "^"))]
    for pattern in _ERROR_LINES:
        for line in reversed(lines):
            if pattern.search(line):
                return line[:300]
    return ""
