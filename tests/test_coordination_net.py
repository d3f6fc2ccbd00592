"""The one free_port that the rendezvous and the vLLM server share."""
from __future__ import annotations

import socket

import pytest

from coordination.net import free_port


@pytest.mark.parametrize("host, family, bind_to", [("127.0.0.1", socket.AF_INET, "127.0.0.1"),
                                                    ("localhost", socket.AF_INET, "127.0.0.1"),
                                                    ("::1", socket.AF_INET6, "::1")])
def test_free_port_is_a_port_a_server_can_bind_at_once(host, family, bind_to):
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        port = free_port(host)
    except OSError as exc:   # a kernel without ::1 configured
        pytest.skip(f"cannot bind {host}: {exc}")
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bind_to, port))
        s.listen()
        assert 1024 <= port <= 65535 and s.getsockname()[1] == port
