"""Rotary position embedding's precomputed cos/sin (none, linear and Llama-3 scaling).

The attention layer applies it, with the K/V write (``AttentionBackend.rope_and_write_kv``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kvscale.kernels.rotary import compute_cos_sin_cache


class RotaryEmbedding(nn.Module):
    """Holds ``cos_sin_cache [max_position, head_dim]`` fp32 (``kernels.rotary``'s layout)."""

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        cache = compute_cos_sin_cache(head_dim, max_position, base, rope_scaling)
        self.register_buffer("cos_sin_cache", cache.float(), persistent=False)
