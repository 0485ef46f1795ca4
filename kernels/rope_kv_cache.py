"""Rotary embedding of q and k and the KV-cache write, in one launch.

The attention layer's two small kernels before attention (``rotary.rotary_embedding``
on q and k, then ``kv_cache.write_kv_cache`` of k and v) read and write the same rows;
at batch 1 each is a few microseconds of launch-bound work per layer. Here one program
per token rotates its q heads into a new tensor, rotates its k heads and stores them
with its v heads at the token's slot, bit for bit as the two kernels would: the rotation
in fp32 rounded once to k's dtype, then (FP8 cache) divided by the scale and rounded
to E4M3, then cast to the cache dtype.

Layouts: those of ``kernels.rotary`` (positions ``[T]`` int64, q ``[T, Hq, D]``, k and v
``[T, Hk, D]``, cos_sin_cache ``[max_position, D]`` fp32) and ``kernels.kv_cache``
(caches ``[num_blocks, block_size, Hk, D]``, slot_mapping ``[T]`` int64, < 0: not
written; k_scale, v_scale ``[]`` fp32 for an FP8 cache). q, k and v are not modified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels import kv_cache, rotary
from kvscale.kernels._utils import next_power_of_2
from kvscale.kernels.fp8 import is_fp8, quantize_e4m3
from kvscale.kernels.kv_cache import write_kv_cache_ref
from kvscale.kernels.rotary import rotary_embedding_ref, rotated_halves


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_tokens"])
def _rope_kv_cache_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    num_q_heads,
    max_position,
    num_slots,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    QH_PAD: tl.constexpr,
    KH_PAD: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    live = t < num_tokens
    pos = tl.load(pos_ptr + t, mask=live, other=-1).to(tl.int64)
    rot = (pos >= 0) & (pos < max_position) & live
    offs_d = tl.arange(0, HALF)
    c_mask = (offs_d < HALF) & rot
    cos = tl.load(cos_sin_ptr + pos * stride_c + offs_d, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_c + HALF + offs_d, mask=c_mask, other=0.0)
    sin = sin.to(tl.float32)

    # q -> q_out ([T, Hq, D], contiguous), rotated where the position is in the cache
    q1, q2, q_mask = rotated_halves(
        q_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, rot, live, HALF, QH_PAD
    )
    offs_h = tl.arange(0, QH_PAD)
    dst = q_out_ptr + t * num_q_heads * 2 * HALF + offs_h[:, None] * 2 * HALF + offs_d[None, :]
    tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(dst + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    slot = tl.load(slot_ptr + t, mask=live, other=-1).to(tl.int64)
    write = (slot >= 0) & (slot < num_slots) & live
    k1, k2, k_mask = rotated_halves(
        k_ptr, t, stride_kt, stride_kh, NUM_KV_HEADS, cos, sin, rot, write, HALF, KH_PAD
    )
    # rounded to k's dtype first: what the rotary kernel stores and the write kernel reads
    k1 = k1.to(k_ptr.dtype.element_ty)
    k2 = k2.to(k_ptr.dtype.element_ty)
    offs_k = tl.arange(0, KH_PAD)
    v_off = offs_k[:, None] * stride_vh + offs_d[None, :]
    v1 = tl.load(v_ptr + t * stride_vt + v_off, mask=k_mask, other=0.0)
    v2 = tl.load(v_ptr + t * stride_vt + HALF + v_off, mask=k_mask, other=0.0)
    if QUANT:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        k1 = quantize_e4m3(k1, k_scale)
        k2 = quantize_e4m3(k2, k_scale)
        v1 = quantize_e4m3(v1, v_scale)
        v2 = quantize_e4m3(v2, v_scale)
    row = slot * NUM_KV_HEADS * 2 * HALF + offs_k[:, None] * 2 * HALF + offs_d[None, :]
    cache_ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + row, k1.to(cache_ty), mask=k_mask)
    tl.store(k_cache_ptr + row + HALF, k2.to(cache_ty), mask=k_mask)
    tl.store(v_cache_ptr + row, v1.to(cache_ty), mask=k_mask)
    tl.store(v_cache_ptr + row + HALF, v2.to(cache_ty), mask=k_mask)


def rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rotated q (new, ``[T, Hq, D]`` contiguous, q's dtype); the rotated k and v
    stored at ``slot_mapping`` (see module doc)."""
    check_rope_write(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
    )
    rotary.check_kernel_layout(q=q, k=k, v=v, cos_sin_cache=cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    quant = is_fp8(k_cache.dtype)
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    qh_pad = next_power_of_2(num_q_heads)
    _rope_kv_cache_kernel[(num_tokens,)](
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if quant else q_out,
        v_scale if quant else q_out,
        num_tokens,
        num_q_heads,
        cos_sin_cache.shape[0],
        k_cache.shape[0] * k_cache.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        QH_PAD=qh_pad,
        KH_PAD=next_power_of_2(num_kv_heads),
        QUANT=quant,
        num_warps=max(1, min(8, qh_pad * half // 512)),
    )
    return q_out


def rope_and_write_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`rope_and_write_kv`: the two references in turn."""
    check_rope_write(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale
    )
    q_out, k_rot = q.contiguous().clone(), k.clone()
    rotary_embedding_ref(positions, q_out, k_rot, cos_sin_cache)
    write_kv_cache_ref(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_out


def check_rope_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    rotary.check_shapes(positions, q, k, cos_sin_cache)
    kv_cache.check_shapes(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
