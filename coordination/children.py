"""Child processes a node starts (torchrun, servers): own process group, bounded stop, and a
watch on the peers while they run, so a dead node ends a collective instead of hanging it."""
from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

from coordination.diagnose import relevant_lines
from coordination.node import Node
from coordination.procgroup import die_with_parent, stop_group
from coordination.records import ensure_dir

log = logging.getLogger("baton.children")


class ChildFailed(RuntimeError):
    """The child exited non-zero or was stopped because a peer was lost."""


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
    """Run `cmd` in its own process group, output appended to `log_file`; while it runs, check
    this node's fence and the peers' heartbeats. A lost peer or a fence stops the child group."""
    node.check_fence()  # a superseded node neither starts a child nor touches its log
    ensure_dir(log_file.parent)
    peers = [r for r in peers if r != node.rank]
    with open(log_file, "ab") as out:
        out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {' '.join(cmd)}\n".encode())
        out.flush()
        start = out.tell()  # this attempt's output begins here
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    try:
        while True:
            try:
                code = proc.wait(timeout=check_every)
                break
            except subprocess.TimeoutExpired:
                pass
            node.check_fence()
            for r in peers:
                view = node.peer_view(r)
                if view.lost or view.exited:
                    raise ChildFailed(f"stopped {what}: rank {r} was {'lost' if view.lost else 'gone'} "
                                      f"({view.describe()})")
            if on_tick is not None:
                on_tick()
    finally:
        stop_group(proc)
    if code != 0:
        raise ChildFailed(f"{what} exited with code {code}; from {log_file}:\n{why(log_file, start)}")
