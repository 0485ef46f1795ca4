"""The paged KV pool of one rank: every layer's K and V blocks in one object.

Layout of one layer: ``k`` and ``v``, each ``[num_blocks, block_size, num_kv_heads,
head_dim]`` in the cache dtype (this rank's KV heads only): the model dtype, or FP8 (E4M3,
one byte per element, so twice bf16's tokens in the same memory). ``k_scale``/``v_scale``
are per-layer fp32 scalars on the device: an FP8 cache holds ``x / scale``; 1.0 and unused
otherwise. The attention backends write and read a layer through its ``LayerKV``; the
attention layers are bound to theirs once the pool is allocated (``bind``). Scales survive
re-allocation (``set_scales``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvscale.kernels.fp8 import is_fp8


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
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    @property
    def quantized(self) -> bool:
        """The cache stores FP8 with per-layer scales."""
        return is_fp8(self.dtype)

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
        for i in range(self.num_layers):
            self.layers.append(
                LayerKV(
                    k=torch.empty(shape, dtype=self.dtype, device=self.device),
                    v=torch.empty(shape, dtype=self.dtype, device=self.device),
                    k_scale=torch.tensor(self.k_scales[i], dtype=torch.float32, device=self.device),
                    v_scale=torch.tensor(self.v_scales[i], dtype=torch.float32, device=self.device),
                )
            )

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """Sets every layer's scales (kept for later allocations; written in place, so
        captured CUDA graphs see them)."""
        if len(k_scales) != self.num_layers or len(v_scales) != self.num_layers:
            raise ValueError(f"{len(k_scales)}/{len(v_scales)} scales for {self.num_layers} layers")
        bad = [s for s in (*k_scales, *v_scales) if not (s > 0 and s < float("inf"))]
        if bad:
            raise ValueError(f"KV-cache scales must be positive and finite, got {bad[:4]}")
        self.k_scales, self.v_scales = [float(s) for s in k_scales], [float(s) for s in v_scales]
        for kv, ks, vs in zip(self.layers, self.k_scales, self.v_scales, strict=True):
            kv.k_scale.fill_(ks)
            kv.v_scale.fill_(vs)

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
