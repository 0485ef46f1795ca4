"""The per-step context the attention layers read (set by the model runner around a forward)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvscale.server.attention.backend import AttentionBackend
from kvscale.server.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    backend: AttentionBackend
    attn: AttentionMetadata


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention layers run only inside the model runner's forward context")
    return _current


@contextmanager
def forward_context(backend: AttentionBackend, attn: AttentionMetadata) -> Iterator[None]:
    global _current
    prev, _current = _current, ForwardContext(backend, attn)
    try:
        yield
    finally:
        _current = prev
