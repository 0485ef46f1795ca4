"""Rotary position embedding with precomputed cos/sin (none, linear and Llama-3 scaling)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvscale.server.layers import ops


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """``[head_dim/2]`` fp32 inverse frequencies, as transformers computes them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    low = float(rope_scaling["low_freq_factor"])
    high = float(rope_scaling["high_freq_factor"])
    old_ctx = float(rope_scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_cos_sin_cache(
    head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:
    """``[max_position, head_dim]`` fp32: cos of each frequency, then sin."""
    inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        cache = compute_cos_sin_cache(head_dim, max_position, base, rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """In place on ``q [T, Hq, D]`` and ``k [T, Hk, D]``; ``positions [T]`` int64."""
        ops.rotary_embedding(positions, q, k, self.cos_sin_cache)
