"""Loopback ports for servers the tests start in other processes (`tollgate serve`, redis-server).

Why not the usual bind-to-0-and-close: the kernel then hands the same port to the next outgoing
connection of any process (ports come from one ephemeral range, `ip_local_port_range`), and the suite
makes thousands of connections on two xdist workers at once; a server started a moment later then failed
with "address already in use". Ports below the ephemeral range are never given to outgoing connections;
each xdist worker draws from its own slice of them, in turn, and skips one that is taken now.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from collections.abc import Iterator
from functools import cache
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 10_000  # below this are ports services commonly listen on


@cache
def _candidates() -> Iterator[int]:
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32_768  # Linux's default
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    size = (first_ephemeral - _LOWEST) // workers
    start = _LOWEST + worker * size
    offset = random.randrange(size)  # another run of the suite on this host starts elsewhere in the slice
    return itertools.cycle([start + (offset + i) % size for i in range(size)])


def free_port() -> int:
    """A loopback port free now that no outgoing connection can take before a server binds it."""
    candidates = _candidates()
    for port in candidates:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("unreachable: the candidates cycle forever")
