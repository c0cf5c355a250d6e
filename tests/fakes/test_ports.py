"""`tests.fakes.ports`: ports below the ephemeral range, each free when given, never twice in a row."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.fakes.ports import free_port


def test_ports_are_free_below_the_ephemeral_range_and_differ() -> None:
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(10_000 <= port < first_ephemeral for port in ports)
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports[-1]))  # free as given


def test_a_port_taken_now_is_skipped() -> None:
    """Candidates come in order: the one after a given port is taken by a server here, so it is skipped."""
    given = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", given + 1))
        held.listen()
        assert free_port() not in (given + 1, given)
