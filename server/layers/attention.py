"""The attention layer: writes new K/V into this layer's paged cache, then attends."""

from __future__ import annotations

import torch
from torch import nn

from kvscale.server.forward_context import get_forward_context


class Attention(nn.Module):
    """``q [T, Hq*D]``, ``k, v [T, Hk*D]`` -> ``[T, Hq*D]``.

    The model runner binds ``k_cache``/``v_cache`` (``[num_blocks, block_size, Hk, D]``)
    after allocating the KV pool.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        ctx.backend.write_kv(k, v, self.k_cache, self.v_cache, ctx.attn)
        out = ctx.backend.attend(q, self.k_cache, self.v_cache, ctx.attn, self.scale)
        return out.view(-1, self.num_heads * self.head_dim)
