"""Ports on this machine: the one helper that the driver (torchrun's rendezvous) and the vLLM
engine (its server) share."""
from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port that nobody listens on at `host` right now (the caller's server binds it a moment
    later). IPv6 when `host` is an IPv6 address; "localhost" means 127.0.0.1."""
    host = "127.0.0.1" if host == "localhost" else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
