"""Scatter a step's new K/V into the paged KV cache (K and V in one launch).

Layouts:
    k, v:          ``[T, num_kv_heads, head_dim]`` (any float dtype; last dim contiguous)
    k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous
    slot_mapping:  ``[T]`` int64, slot = ``block_id * block_size + offset_in_block``;
                   a negative slot means "do not write" (padding).
Values are cast to the cache dtype. An FP8 (E4M3) cache stores ``x / scale`` rounded to
E4M3 with one fp32 scale per layer for K and one for V (``k_scale``, ``v_scale``: ``[]``
tensors on the device, read by the kernel so that CUDA graphs see later updates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import is_interpreter, next_power_of_2
from kvscale.kernels.fp8 import is_fp8, quantize_e4m3, quantize_fp8_ref


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
    QUANT: tl.constexpr,
):
    # One program moves TOKENS tokens x BLOCK elements of K and of V, so that several
    # independent loads are in flight per thread.
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    pb = tl.program_id(1)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    row = NUM_KV_HEADS * HEAD_DIM
    offs = pb * BLOCK + tl.arange(0, BLOCK)
    head = offs // HEAD_DIM
    d = offs % HEAD_DIM
    ok = (slot >= 0) & (slot < num_slots) & (t < num_tokens)
    mask = ok[:, None] & (offs < row)[None, :]
    dst = slot[:, None] * row + offs[None, :]
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t64 * stride_kt + (head * stride_kh + d)[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t64 * stride_vt + (head * stride_vh + d)[None, :], mask=mask, other=0.0)
    if QUANT:
        k = quantize_e4m3(k, tl.load(k_scale_ptr))
        v = quantize_e4m3(v, tl.load(v_scale_ptr))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_shapes(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if is_fp8(k_cache.dtype) and (k_scale is None or v_scale is None):
        raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k, v must be [T, Hkv, D] of one shape, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache, v_cache must be [num_blocks, block_size, Hkv, D] of one shape")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} != {tuple(k.shape[1:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got {tuple(slot_mapping.shape)}")


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes ``k[t], v[t]`` to slot ``slot_mapping[t]`` of ``k_cache, v_cache`` (skips < 0);
    an FP8 cache gets ``k / k_scale`` and ``v / v_scale``."""
    check_shapes(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    quant = is_fp8(k_cache.dtype)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    row = num_kv_heads * head_dim
    block = min(next_power_of_2(row), 4096)
    tokens = 1 if is_interpreter() else 4
    grid = (triton.cdiv(num_tokens, tokens), triton.cdiv(row, block))
    _write_kv_cache_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if quant else k,
        v_scale if quant else v,
        num_tokens,
        num_slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=block,
        TOKENS=tokens,
        QUANT=quant,
        num_warps=4,
    )


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Pure-torch reference of :func:`write_kv_cache`."""
    check_shapes(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k.shape[1:]
    k, v = k[keep], v[keep]
    if is_fp8(k_cache.dtype):
        assert k_scale is not None and v_scale is not None
        k, v = quantize_fp8_ref(k, k_scale), quantize_fp8_ref(v, v_scale)
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v.to(v_cache.dtype)
