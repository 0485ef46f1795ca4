"""Framing of the engine's output pipe: whole messages out of arbitrary byte pieces."""

from __future__ import annotations

import os
import threading

from kvscale.server.process.frames import FrameBuffer, encode_message, write_message

MESSAGES = [("ready", {"a": 1}), ("step", [("r", 0, 7, None)] * 50, 1.5), ("stats",), "x" * 70000]


def test_messages_come_out_whole_whatever_the_pieces() -> None:
    stream = b"".join(encode_message(m) for m in MESSAGES)
    for piece in (1, 3, 8, 9, 4096, len(stream)):
        frames = FrameBuffer()
        got = []
        for i in range(0, len(stream), piece):
            got += frames.feed(stream[i : i + piece])
        assert got == MESSAGES, piece
        assert frames.pending_bytes == 0


def test_a_partial_message_waits_for_the_rest() -> None:
    frame = encode_message(("step", list(range(100))))
    frames = FrameBuffer()
    assert frames.feed(frame[:-1]) == []
    assert frames.pending_bytes == len(frame) - 1
    assert frames.feed(frame[-1:]) == [("step", list(range(100)))]


def test_write_message_writes_a_frame_larger_than_the_pipe_buffer() -> None:
    r, w = os.pipe()
    big = b"\x01" * (1 << 20)  # larger than a pipe's 64 KiB buffer: several writes

    def writer() -> None:
        write_message(w, big)
        os.close(w)

    t = threading.Thread(target=writer)
    t.start()
    frames, got = FrameBuffer(), []
    while chunk := os.read(r, 65536):
        got += frames.feed(chunk)
    t.join()
    os.close(r)
    assert got == [big]
