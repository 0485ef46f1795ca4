"""The attention-backend interface over the paged KV cache.

KV cache of one layer: a ``LayerKV`` (``worker.kv_pool``) whose ``k`` and ``v`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Backends write the step's new
K/V into their slots, then attend each new query token to its sequence's cached
tokens (causal), reading blocks through the block table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.layers import ops
from kvscale.server.worker.kv_pool import LayerKV


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> None:
        """Stores ``k, v [T, Hk, D]`` at ``meta.slot_mapping``."""

    def rope_and_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotates ``q [T, Hq, D]`` and ``k`` by ``positions [T]`` (``kernels.rotary``'s
        layout and maths), stores the rotated k and v (:meth:`write_kv`) and returns the
        rotated q; the inputs are left as they were. Backends may fuse the two."""
        q, k = q.clone(), k.clone()
        ops.rotary_embedding(positions, q, k, cos_sin_cache)
        self.write_kv(k, v, kv, meta)
        return q

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``q [T, Hq, D]`` -> ``[T, Hq, D]``; each query sees its sequence up to itself."""

    def rope_write_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """:meth:`rope_and_write_kv`, then :meth:`attend` with the rotated q; backends may
        do the two in fewer kernels."""
        q = self.rope_and_write_kv(q, k, v, positions, cos_sin_cache, kv, meta)
        return self.attend(q, kv, meta, scale)


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """``name``: "auto" (Triton on CUDA, torch otherwise), "torch" or "triton"."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from kvscale.server.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kvscale.server.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend: {name!r} is not one of 'auto', 'torch', 'triton'")
