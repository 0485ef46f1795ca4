"""The paged KV pool of one rank: every layer's K and V blocks in one object.

Layout of one layer: ``k`` and ``v``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]`` in the cache dtype (this rank's KV heads only). ``k_scale``/``v_scale`` are
per-layer fp32 scalars, 1.0 unless the cache is quantized. The attention backends
write and read a layer through its ``LayerKV``; the attention layers are bound to theirs
once the pool is allocated (``bind``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class LayerKV:
    """One layer's cache: ``k``, ``v`` ``[num_blocks, block_size, Hk, D]``; scales ``[]`` fp32."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


class BindsKV(Protocol):
    """An attention layer: holds the ``LayerKV`` it reads and writes."""

    kv: LayerKV | None
    num_kv_heads: int
    head_dim: int


class KVPool:
    """Allocates and owns the K/V blocks of ``num_layers`` layers."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        self.layers: list[LayerKV] = []

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (K and V)."""
        elems = 2 * self.block_size * self.num_kv_heads * self.head_dim * self.num_layers
        return elems * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def allocate(self, num_blocks: int) -> None:
        """(Re)allocates ``num_blocks`` blocks per layer (0 frees the pool); contents are
        undefined. Layers bound earlier must be bound again."""
        self.layers = []  # drop the old tensors before taking new memory
        self.num_blocks = num_blocks
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        for _ in range(self.num_layers):
            self.layers.append(
                LayerKV(
                    k=torch.empty(shape, dtype=self.dtype, device=self.device),
                    v=torch.empty(shape, dtype=self.dtype, device=self.device),
                    k_scale=torch.ones((), dtype=torch.float32, device=self.device),
                    v_scale=torch.ones((), dtype=torch.float32, device=self.device),
                )
            )

    def bind(self, attn_layers: Sequence[BindsKV]) -> None:
        """Points each attention layer at its ``LayerKV`` (layer ``i`` at ``layers[i]``)."""
        if len(attn_layers) != self.num_layers:
            raise ValueError(f"{len(attn_layers)} attention layers for a pool of {self.num_layers}")
        for layer, kv in zip(attn_layers, self.layers, strict=True):
            if (layer.num_kv_heads, layer.head_dim) != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"layer has {layer.num_kv_heads} KV heads of {layer.head_dim}, the pool "
                    f"{self.num_kv_heads} of {self.head_dim}"
                )
            layer.kv = kv
