"""The attention layer: writes new K/V into this layer's paged cache, then attends.

The layer holds its ``LayerKV`` (bound by the worker's ``KVPool``) and calls the step's
attention backend (the forward context). Under ``torch.compile`` the call is one opaque
custom op, ``kvscale::paged_attention``, so that Inductor compiles the rest of each
layer (norms, projections, rotary, MLP) around it and attention stays on the backend's
kernels: the piecewise split SGLang and vLLM use.
"""

from __future__ import annotations

import torch
from torch import nn

from kvscale.server.attention.forward_context import get_forward_context
from kvscale.server.worker.kv_pool import LayerKV


@torch.library.custom_op("kvscale::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q [T, Hq, D]``, ``k, v [T, Hk, D]`` -> ``[T, Hq, D]`` through the current step's
    attention backend and metadata (the forward context)."""
    ctx = get_forward_context()
    kv = LayerKV(k_cache, v_cache, k_scale, v_scale)
    ctx.backend.write_kv(k, v, kv, ctx.attn)
    return ctx.backend.attend(q, kv, ctx.attn, scale)


@paged_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


def _load_scalar(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"a per-tensor KV scale must hold one value, got {tuple(loaded.shape)}")
    param.data.copy_(loaded.reshape(()))


class Attention(nn.Module):
    """``q [T, Hq*D]``, ``k, v [T, Hk*D]`` -> ``[T, Hq*D]`` (this rank's heads)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv: LayerKV | None = None  # bound by KVPool.bind
        # An FP8-KV checkpoint's scales, as loaded (NaN: it has none); the worker hands
        # them to the KV pool, whose LayerKV holds the scales in use.
        for name in ("k_scale", "v_scale"):
            p = nn.Parameter(torch.tensor(float("nan"), dtype=torch.float32), requires_grad=False)
            p.weight_loader = _load_scalar  # type: ignore[attr-defined]
            self.register_parameter(name, p)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        kv = self.kv
        if kv is None:
            raise RuntimeError("attention layer has no KV cache bound (KVPool.bind)")
        if torch.compiler.is_compiling():
            out = torch.ops.kvscale.paged_attention(
                q, k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, self.scale
            )
        else:
            ctx = get_forward_context()
            ctx.backend.write_kv(k, v, kv, ctx.attn)
            out = ctx.backend.attend(q, kv, ctx.attn, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
