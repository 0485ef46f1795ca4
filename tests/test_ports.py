"""``tests.ports.free_port``: ports that outgoing connections cannot take before the
process they are for binds them."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.ports import LOWEST, ephemeral_range, free_port


def test_ports_are_distinct_free_and_outside_the_ephemeral_range() -> None:
    eph = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    for port in ports:
        assert port >= LOWEST and port not in eph
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(f) == range(40000, 50001)
    assert ephemeral_range(tmp_path / "missing") == range(32768, 61000)
