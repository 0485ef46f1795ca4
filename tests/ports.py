"""Loopback ports for the processes tests start.

A port is chosen here and bound later by another process, so another socket can take it in
between. Outgoing connections (kopf's watches, HTTP clients, Prometheus's scrapes) take
theirs from the kernel's ephemeral range, which is where a port the OS picks for a bind to
port 0 comes from too: a clean-clone CI run once lost a server's port to one of them
("address already in use"). So ports come from below that range, at random, never the same
one twice in a session, and each is checked free when handed out.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000  # above the well-known and most registered services' ports
_handed_out: set[int] = set()
_rng = random.SystemRandom()


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The kernel's range for outgoing connections' ports (Linux's default elsewhere)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port that is free now, outside the ephemeral range and not handed out
    before in this process (the OS's pick if no such port is found)."""
    eph = ephemeral_range()
    candidates = [r for r in (range(LOWEST, eph.start), range(eph.stop, 65536)) if len(r) >= 1000]
    for _ in range(200 if candidates else 0):
        port = _rng.choice(_rng.choice(candidates))
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port
