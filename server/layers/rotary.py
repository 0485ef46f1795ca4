"""Rotary position embedding with precomputed cos/sin (none, linear and Llama-3 scaling)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvscale.kernels.rotary import compute_cos_sin_cache
from kvscale.server.layers import ops


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        cache = compute_cos_sin_cache(head_dim, max_position, base, rope_scaling)
        self.register_buffer("cos_sin_cache", cache.float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """In place on ``q [T, Hq, D]`` and ``k [T, Hk, D]``; ``positions [T]`` int64."""
        ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
