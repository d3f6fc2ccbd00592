"""What a failed attempt's log says, and what to do about it: errors tell the user what to do.

A torchrun failure ends in pages of tracebacks from every local rank and the agent; the cause is
a line or two among them (the exception, or gloo/NCCL's own words). `relevant_lines` picks those
from a log's tail so every node's console shows them, and `advice` maps them to the fix through
one small table: a network misconfiguration wants `coordination.socket_ifname`, not more attempts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Lines worth showing: exceptions (a traceback's last line), errors, and the collectives' words.
_RELEVANT = re.compile(
    r"(Error|Exception|error:|gloo|Gloo|NCCL|No space left|Connection refused|timed out|Killed|Signals\."
    r"|failed \(exitcode)")
# Noise that matches the above but says nothing: traceback frames and torchrun's banners.
_NOISE = re.compile(r"^\s*(File \"|Traceback \(most recent call last\)|raise |\^+$|return |warnings\.warn)")


def relevant_lines(text: str, limit: int = 8, width: int = 300) -> list[str]:
    """The last `limit` distinct lines of `text` that name an error, oldest first, each cut to
    `width` characters. Local ranks print the same exception each: it is shown once."""
    picked: list[str] = []
    seen: set[str] = set()
    for line in reversed(text.splitlines()):
        line = line.strip()
        # "[rank3]: RuntimeError: x" from four ranks is one message
        key = re.sub(r"^\[(default)?rank\d+\]:", "", line)
        if not key.strip() or _NOISE.match(key) or not _RELEVANT.search(key):
            continue
        key = key.strip()
        if key in seen:
            continue
        seen.add(key)
        picked.append(line[:width])
        if len(picked) >= limit:
            break
    return picked[::-1]


@dataclass(frozen=True)
class Cause:
    name: str
    pattern: re.Pattern
    advice: str  # may name {path}, the file or folder the error names (ENOSPC)


CAUSES: tuple[Cause, ...] = (
    Cause("disk full", re.compile(r"No space left on device|ENOSPC|Errno 28"),
          "the disk holding {path} is full: free space there (`df -h {path}`), or move the run to a larger "
          "filesystem, then restart every node with its command; more attempts would fail the same way"),
    # Before "network": an established gloo pair whose peer vanished (kill -9, a crash, the OOM
    # killer) reads a reset too, and there socket settings are not the fix and a retry is.
    Cause("peer lost", re.compile(r"(Read|Write) error \[[^\]]*\]:\d+: Connection reset by peer"
                                  r"|Connection closed by peer"),
          "a trainer process of another node ended in the middle of a collective (killed, crashed or out of "
          "memory): that node's trainer.log and driver.log say why; the iteration's next attempt (up to "
          "train.max_attempts) retries it once that node runs again with its command"),
    Cause("network", re.compile(
        r"loopback address as fallback|GLOO_SOCKET_IFNAME|NCCL_SOCKET_IFNAME|Connection refused|ECONNREFUSED"
        r"|gloo.*(connect|bind|Address)|Gloo connectFullMesh|127\.0\.0\.1|Address already in use|DistNetworkError"
        r"|Rendezvous\w*(Timeout|Connection)Error|rendezvous.*timed? ?out|timed out.*rendezvous"
        r"|client socket has timed out|Connection reset by peer|Bootstrap : no socket interface|NCCL.*socket",
        re.IGNORECASE),
          "a network problem between the nodes' trainers (gloo/NCCL could not connect, or bound to "
          "loopback): set coordination.socket_ifname to the interface the nodes reach each other on "
          "(see `ip -br addr`, e.g. coordination.socket_ifname=eth0) and, if the master is reached at another "
          "address, coordination.master_addr; more attempts would fail the same way"),
)


def diagnose(text: str) -> Cause | None:
    """The first cause in CAUSES whose pattern appears in `text` (table order is priority)."""
    for cause in CAUSES:
        if cause.pattern.search(text):
            return cause
    return None


_PATH = re.compile(r"No space left on device:?\s*'([^']+)'")


def advice(text: str, default_path: str = "the log path") -> str | None:
    """What to do about the failure `text` describes, or None when no row of CAUSES matches."""
    cause = diagnose(text)
    if cause is None:
        return None
    m = _PATH.search(text)
    return cause.advice.format(path=m.group(1) if m else default_path)
