"""Child processes a node starts (torchrun, servers): own process group, bounded stop, and a
watch on the peers while they run, so a dead node ends a collective instead of hanging it."""
from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

from coordination.node import Node
from coordination.procgroup import die_with_parent, stop_group
from coordination.records import ensure_dir, open_own

log = logging.getLogger("baton.children")


class ChildFailed(RuntimeError):
    """The child exited non-zero or was stopped because a peer was lost."""


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def run_watched(cmd: list[str], *, env: dict, log_file: Path, node: Node, peers: Iterable[int],
                what: str, check_every: float = 2.0, on_tick: Callable[[], None] | None = None) -> None:
    """Run `cmd` in its own process group, output appended to `log_file`; while it runs, check
    this node's fence and the peers' heartbeats. A lost peer or a fence stops the child group."""
    ensure_dir(log_file.parent)
    peers = [r for r in peers if r != node.rank]
    with open_own(log_file, "ab") as out:
        out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: {' '.join(cmd)}\n".encode())
        out.flush()
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
        raise ChildFailed(f"{what} exited with code {code}; last lines of {log_file}:\n{tail(log_file)}")
