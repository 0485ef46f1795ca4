"""The per-step context the attention layers read (set by the model runner around a forward)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvscale.server.attention.backend import AttentionBackend
from kvscale.server.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kvscale.server.layers.prefetch import WeightPrefetch


@dataclass
class ForwardContext:
    backend: AttentionBackend
    attn: AttentionMetadata
    prefetch: WeightPrefetch | None = None  # weights into L2 ahead of their GEMMs


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention layers run only inside the model runner's forward context")
    return _current


def current_prefetch() -> WeightPrefetch | None:
    """The running forward's weight prefetcher (None: none, or outside a forward)."""
    return _current.prefetch if _current is not None else None


@contextmanager
def forward_context(
    backend: AttentionBackend, attn: AttentionMetadata, prefetch: WeightPrefetch | None = None
) -> Iterator[None]:
    global _current
    prev, _current = _current, ForwardContext(backend, attn, prefetch)
    try:
        yield
    finally:
        _current = prev
