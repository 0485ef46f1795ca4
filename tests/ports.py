"""Loopback ports for the processes tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
