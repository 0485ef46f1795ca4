"""The attention layer: rotates q and k, writes the new K/V into this layer's paged
cache, then attends.

The layer holds its ``LayerKV`` (bound by the worker's ``KVPool``) and calls the step's
attention backend (the forward context). Under ``torch.compile`` the call is one opaque
custom op, ``kvscale::paged_attention``, so that Inductor compiles the rest of each
layer (norms, projections, MLP) around it and attention stays on the backend's
kernels: the op the piecewise backend splits the graph at (``server/compilation``). It
writes into an output buffer allocated before it (so inside the previous piece, at an
address a CUDA graph of the next piece can read), and it attends only the step's real
tokens: rows past the metadata's ``slot_mapping`` pad a captured size and are left 0.
"""

from __future__ import annotations

import torch
from torch import nn

from kvscale.server.attention.forward_context import get_forward_context
from kvscale.server.compilation.direct_calls import register_direct_call
from kvscale.server.layers.rotary import RotaryEmbedding
from kvscale.server.worker.kv_pool import LayerKV


def paged_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """``q [T, Hq, D]``, ``k, v [T, Hk, D]`` (not rotated yet), ``positions [T]`` ->
    ``out [T, Hq, D]`` through the current step's attention backend and metadata (the
    forward context). Only the first ``n`` rows (``n = len(slot_mapping)``) are real
    tokens; the rest pad a captured size."""
    ctx = get_forward_context()
    kv = LayerKV(k_cache, v_cache, k_scale, v_scale)
    n = ctx.attn.slot_mapping.shape[0]
    if n < q.shape[0]:
        q, k, v, positions, out = q[:n], k[:n], v[:n], positions[:n], out[:n]
    out.copy_(
        ctx.backend.rope_write_and_attend(q, k, v, positions, cos_sin_cache, kv, ctx.attn, scale)
    )


paged_attention = torch.library.custom_op(
    "kvscale::paged_attention", paged_attention_impl, mutates_args=("k_cache", "v_cache", "out")
)
# between captured pieces it is called without the dispatcher's per-call cost
register_direct_call("kvscale::paged_attention", paged_attention_impl)


@paged_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    return None


def _load_scalar(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"a per-tensor KV scale must hold one value, got {tuple(loaded.shape)}")
    param.data.copy_(loaded.reshape(()))


class Attention(nn.Module):
    """``q [T, Hq*D]``, ``k, v [T, Hk*D]`` (before the rotary embedding), ``positions [T]``
    int64 -> ``[T, Hq*D]`` (this rank's heads). The rotary embedding is applied here, with
    the K/V write, so that a backend can do both in one kernel."""

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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        kv = self.kv
        if kv is None:
            raise RuntimeError("attention layer has no KV cache bound (KVPool.bind)")
        if torch.compiler.is_compiling():
            # zeros: padding rows stay finite through the layers after attention
            out = torch.zeros_like(q)
            torch.ops.kvscale.paged_attention(
                q,
                k,
                v,
                positions,
                rotary.cos_sin_cache,
                kv.k,
                kv.v,
                kv.k_scale,
                kv.v_scale,
                out,
                self.scale,
            )
        else:
            ctx = get_forward_context()
            out = ctx.backend.rope_write_and_attend(
                q, k, v, positions, rotary.cos_sin_cache, kv, ctx.attn, self.scale
            )
        return out.reshape(-1, self.num_heads * self.head_dim)
