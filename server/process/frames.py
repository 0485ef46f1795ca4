"""Pickled messages over a one-way pipe, framed so the reader never blocks on a partial one.

The engine process writes each message whole with ``write_message`` (a blocking write of
an 8-byte little-endian length, then the pickle). The API process reads the pipe on its
event loop through ``MessageProtocol``, which buffers bytes until a message is complete.

Why not ``multiprocessing.Connection.recv`` on the event loop: uvloop (what uvicorn
runs) puts every file descriptor it watches into non-blocking mode, so a ``recv`` that
meets half a message raises ``BlockingIOError``, and on a duplex pipe the other
direction's ``send`` does too once the socket buffer fills.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")  # payload length in bytes


def encode_message(msg: Any) -> bytes:
    """One frame: the payload's length, then ``msg`` pickled."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def write_message(fd: int, msg: Any) -> None:
    """Writes one frame to a blocking file descriptor (all of it; raises OSError, e.g.
    BrokenPipeError when the reader is gone)."""
    view = memoryview(encode_message(msg))
    while view:
        view = view[os.write(fd, view) :]


class FrameBuffer:
    """Collects bytes as they arrive; ``feed`` returns the messages they complete."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        messages: list[Any] = []
        pos = 0
        while len(buf) - pos >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buf, pos)
            end = pos + _HEADER.size + size
            if len(buf) < end:
                break
            messages.append(pickle.loads(bytes(buf[pos + _HEADER.size : end])))
            pos = end
        del buf[:pos]
        return messages

    @property
    def pending_bytes(self) -> int:
        """Bytes of a message not yet complete."""
        return len(self._buf)


class MessageProtocol(asyncio.Protocol):
    """Calls ``on_message`` for each whole message read from a pipe (on the event loop),
    and ``on_closed`` once when the pipe closes (the writer exited or closed it)."""

    def __init__(self, on_message: Callable[[Any], None], on_closed: Callable[[], None]) -> None:
        self._frames = FrameBuffer()
        self._on_message = on_message
        self._on_closed = on_closed
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except Exception:  # a corrupt frame: nothing after it can be trusted
            log.exception("unreadable message on the engine pipe; closing it")
            if self._transport is not None:
                self._transport.close()
            return
        for msg in messages:
            try:
                self._on_message(msg)
            except Exception:
                log.exception("handling a message from the engine process failed")

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_closed()
