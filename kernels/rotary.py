"""Rotary position embedding (NeoX / HF-Llama ``rotate_half`` layout), in place.

Layouts:
    positions:     ``[T]`` int64 absolute positions
    q:             ``[T, num_heads, head_dim]``, k: ``[T, num_kv_heads, head_dim]`` (fp16 / bf16 /
                   fp32; views allowed, last dim contiguous), rotated in place
    cos_sin_cache: ``[max_position, head_dim]`` fp32: cos of the head_dim/2 frequencies in the
                   first half of each row, sin in the second half
With ``x1 = x[..., :D/2]``, ``x2 = x[..., D/2:]``: ``out1 = x1*cos - x2*sin``,
``out2 = x2*cos + x1*sin``, computed in fp32 and rounded once to x's dtype. Tokens whose
position is outside the cache are left untouched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import next_power_of_2


@triton.jit
def rotated_halves(
    x_ptr,
    t,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    rot,
    live,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    """Token ``t``'s heads of ``x`` as fp32 halves ``[HEADS_PAD, HALF]`` each, rotated by
    ``cos, sin [HALF]`` where ``rot`` (as loaded otherwise), and the mask of real elements
    (``live``: the token's row is read at all)."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF) & live
    ptr1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = tl.where(rot, x1 * cos[None, :] - x2 * sin[None, :], x1)
    o2 = tl.where(rot, x2 * cos[None, :] + x1 * sin[None, :], x2)
    return o1, o2, mask


@triton.jit
def _rotate_heads(
    x_ptr,
    t,
    stride_t,
    stride_h,
    num_heads,
    cos,
    sin,
    ok,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    o1, o2, mask = rotated_halves(
        x_ptr, t, stride_t, stride_h, num_heads, cos, sin, ok, ok, HALF, HEADS_PAD
    )
    offs_h = tl.arange(0, HEADS_PAD)
    ptr1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + tl.arange(0, HALF)[None, :]
    tl.store(ptr1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_tokens"])
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    num_tokens,
    num_q_heads,
    num_k_heads,
    max_position,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    HALF: tl.constexpr,
    QH_PAD: tl.constexpr,
    KH_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    ok = (pos >= 0) & (pos < max_position) & (t < num_tokens)
    offs_d = tl.arange(0, HALF)
    c_mask = (offs_d < HALF) & ok
    cos = tl.load(cache_ptr + pos * stride_c + offs_d, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_d, mask=c_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, ok, HALF, QH_PAD)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, num_k_heads, cos, sin, ok, HALF, KH_PAD)


def check_shapes(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q [T, Hq, D], k [T, Hk, D] expected, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise ValueError("positions must be [T]")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != q.shape[2]:
        raise ValueError("cos_sin_cache must be [max_position, head_dim]")


def check_kernel_layout(**tensors: torch.Tensor) -> None:
    """What the kernels need beyond :func:`check_shapes`: a head_dim (the last dim of
    each, checked on ``q``) that is a power of two >= 2, and a contiguous last dim."""
    head_dim = tensors["q"].shape[-1]
    if head_dim % 2 or next_power_of_2(head_dim // 2) != head_dim // 2:
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 2")
    strided = [name for name, t in tensors.items() if t.stride(-1) != 1]
    if strided:
        raise ValueError(f"{', '.join(strided)}: the last dim must be contiguous")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates ``q`` and ``k`` in place by the angles of ``positions`` (see module doc)."""
    check_shapes(positions, q, k, cos_sin_cache)
    check_kernel_layout(q=q, k=k, cos_sin_cache=cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    qh_pad = next_power_of_2(num_q_heads)
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        num_tokens,
        num_q_heads,
        k.shape[1],
        cos_sin_cache.shape[0],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HALF=half,
        QH_PAD=qh_pad,
        KH_PAD=next_power_of_2(k.shape[1]),
        num_warps=max(1, min(8, qh_pad * half // 512)),
    )


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Pure-torch reference of :func:`rotary_embedding` (fp32 math, in place)."""
    check_shapes(positions, q, k, cos_sin_cache)
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        x1, x2 = x.float().chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def rope_inv_freq(
    head_dim: int, base: float, rope_scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """``[head_dim/2]`` fp32 inverse frequencies exactly as transformers computes them.

    ``rope_scaling``: None / ``{"rope_type": "default"}``, ``"linear"`` (``factor``) or
    ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``); the key may also be spelled ``"type"``.
    """
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim)
    )
    rope_type = None
    if rope_scaling:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    factor = rope_scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def compute_cos_sin_cache(
    head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """``[max_position, head_dim]`` fp32 on the CPU: ``cos(p * inv_freq)`` then ``sin(...)``.

    Angles are ``float(p) * inv_freq`` in fp32, as transformers' rotary embedding computes them.
    """
    inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
    t = torch.arange(max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
