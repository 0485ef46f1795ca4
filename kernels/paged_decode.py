"""Paged decode attention: one query token per sequence against its cached K/V.

Layouts:
    q:            ``[B, num_heads, head_dim]`` fp16 / bf16 / fp32 (last dim contiguous)
    k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, q's dtype
                  or FP8 (E4M3) with per-layer fp32 ``k_scale``/``v_scale`` (``[]`` tensors)
    block_tables: ``[B, max_blocks_per_seq]`` int32; entries past a sequence's blocks are never read
    seq_lens:     ``[B]`` int32, tokens in the cache for each sequence (including the new one)
    out:          ``[B, num_heads, head_dim]`` in q's dtype

GQA: query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``. One program handles
one (sequence, kv head) and all query heads of that group (padded to >= 16 rows for
``tl.dot``), so every K/V block is loaded once per group. Scores, softmax statistics and the
output accumulator are fp32 (online softmax, exp2 domain); ``tl.dot`` takes its operands in
the storage dtype (16-bit products are exact, accumulation is fp32; fp32 operands use IEEE
precision). ``head_dim`` and ``block_size`` must be powers of two (>= 16 and >= 1).

An FP8 cache is read as is and upcast in registers (exact): to fp16 for 16-bit q (q,
scaled by ``scale``, and the probabilities then enter the dots as fp16), to fp32 for
fp32 q; its scales are folded in: ``k_scale`` into the score scale, ``v_scale`` into the
output.

Split-KV (flash-decoding): with ``num_splits > 1`` each sequence's context is cut into
``num_splits`` chunks processed by separate programs that write partial (max, sum, acc) to
fp32 scratch; a second kernel merges them (merging in the last program of each group to
finish was slower on an H200: NOTES e61 measured). :func:`choose_num_splits` picks the
count.

With ``rope`` (a :class:`RopeWrite`: a decode step's positions, new k and v, the rotary
table and the slots) the kernel also does ``kernels.rope_kv_cache``'s work for the step,
saving its launch: q arrives unrotated and each program rotates its heads; the program
whose context chunk holds the newest token rotates that token's k, stores it and v at its
slot (quantized for an FP8 cache). The rotation and rounding are ``rope_kv_cache``'s, so
the cache is written bit for bit as the two kernels write it. Where the grid fills the GPU
that program reads them back after a barrier, and the output is the two kernels' too;
grids of at most one program an SM (batch-1 decode: latency-bound) rotate q inside the
loop and add the newest token's term from registers after it (another order of summation:
within rounding of the two kernels), so no load waits on the rotary table before the
first K tile (``ROPE_BEFORE_LOOP``, ``ROPE_IN_LOOP``; the latter with
``KVSCALE_ROPE_IN_LOOP=1`` until measured; NOTES e58).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvscale.kernels import rope_kv_cache, rotary
from kvscale.kernels._utils import (
    dot_precision,
    is_interpreter,
    is_power_of_2,
    next_power_of_2,
    num_sms,
)
from kvscale.kernels.fp8 import is_fp8, quantize_e4m3

LOG2E = 1.4426950408889634

# How the kernel does a step's RoPE + KV write (``rope``). Before the loop: q rotated, the
# newest k and v stored and read back by the loop after a barrier; the kernel's registers
# as without rope (8B shapes, bf16, sm_90: 122 a thread under triton 3.6, 96 under 3.8).
# In the loop: q rotated in each iteration (its cos/sin then load beside the first tile's
# block table and K instead of before them), the newest token's term added after the loop
# from registers; more registers (198 / 148), which only costs where an SM holds more than
# one program, so it is taken for grids of at most one program an SM (batch-1 decode),
# NOTES e58, where ``KVSCALE_ROPE_IN_LOOP=1`` (off until measured on a GPU).
ROPE_BEFORE_LOOP = 1
ROPE_IN_LOOP = 2
USE_ROPE_IN_LOOP = os.environ.get("KVSCALE_ROPE_IN_LOOP", "0") == "1"

# Split-KV policy (see choose_num_splits).
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
TARGET_WAVES = 4  # tuned on H100: 64 splits at B=1 ctx 32768 (bench/NOTES.md)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many chunks to split each sequence's context into (1 = no split).

    Without splitting there are ``batch * num_kv_heads`` programs. When that already fills
    the GPU (>= ``num_sms``), or contexts are short, splitting only adds a reduction pass.
    Otherwise aim for about ``TARGET_WAVES * num_sms`` programs, keeping at least
    ``MIN_TOKENS_PER_SPLIT`` tokens per chunk and at most ``MAX_SPLITS`` chunks.
    """
    programs = max(1, batch * num_kv_heads)
    if programs >= num_sms or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    by_occupancy = math.ceil(TARGET_WAVES * num_sms / programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def decode_config(
    head_dim: int, block_size: int, kv_fp8: bool = False, split: bool = False
) -> dict[str, int]:
    """Tile size (tokens per iteration, built from several cache blocks) and launch options.

    Hopper defaults on CUDA; small tiles under the Triton interpreter. An FP8 cache read
    without splits (a program per sequence and KV head: large batches) takes 2 warps and 4
    stages: on an H100 at A's decode shape (256 rows of 520 tokens) 139 against 158 us,
    the best of 48 configs; bf16 and split grids were within 3% of their best as they are
    (bench/NOTES.md "e85 measured", ``bench/tune_kernels.py --only batch``).
    """
    if is_interpreter():
        return {"BLOCK_N": max(16, min(block_size, 32)), "num_warps": 4, "num_stages": 1}
    block_n = max(64 if head_dim <= 128 else 32, min(block_size, 128))
    if kv_fp8 and not split:
        return {"BLOCK_N": block_n, "num_warps": 2, "num_stages": 4}
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3}


@triton.jit
def online_softmax(m_i, l_i, scores):
    """One block of the online softmax, exp2 domain: the running max ``m_i`` and sum
    ``l_i`` ``[R]`` fp32 and the block's ``scores [R, N]`` fp32 -> (the new max, ``alpha``
    ``[R]`` the factor that rescales what was accumulated before, ``p [R, N]``, the new
    sum)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _rotate(x, xp, cos, sin, first):
    """rope_kv_cache's rotation in fp32: x1*cos - x2*sin, x2*cos + x1*sin (``xp``: x's
    partner half, ``first``: which half each element is in)."""
    return tl.where(first, x * cos - xp * sin, x * cos + xp * sin)


@triton.jit
def _rotate_q(q, qp, cos, sin, first, rot):
    """q ``[QG_PAD, D]`` rotated (``rot``: the position is in the table; else as is), in
    q's dtype; ``qp``: q's partner halves, ``cos``/``sin``/``first`` ``[D]``."""
    qx = q.to(tl.float32)
    q_rot = _rotate(qx, qp.to(tl.float32), cos[None, :], sin[None, :], first[None, :])
    return tl.where(rot, q_rot, qx).to(q.dtype)


@triton.jit
def _write_newest_kv(kx, kp, v, cos, sin, first, rot, slot, writes, g, k_cache_ptr,
                     v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_kblk, stride_ktok,
                     stride_khead, offs_d, k_dtype, BLOCK_SIZE: tl.constexpr,
                     KV_FP8: tl.constexpr):
    """The newest token's k (``kx``, partner half ``kp``, fp32 ``[D]``) rotated and rounded
    to ``k_dtype``, and its v, quantized for an FP8 cache, stored at ``slot`` where
    ``writes``; returns the two as stored (the cache's dtype)."""
    k = tl.where(rot, _rotate(kx, kp, cos, sin, first), kx).to(k_dtype)
    if KV_FP8:
        k = quantize_e4m3(k, tl.load(k_scale_ptr))
        v = quantize_e4m3(v, tl.load(v_scale_ptr))
    cache_ty = k_cache_ptr.dtype.element_ty
    k = k.to(cache_ty)
    v = v.to(cache_ty)
    at = ((slot // BLOCK_SIZE) * stride_kblk + (slot % BLOCK_SIZE) * stride_ktok
          + g * stride_khead + offs_d)
    tl.store(k_cache_ptr + at, k, mask=writes)
    tl.store(v_cache_ptr + at, v, mask=writes)
    return k, v


@triton.jit
def _q_operand(q, scale_log2e, KV_FP8: tl.constexpr, KV_F16: tl.constexpr):
    """q as the score dot takes it. With an FP8 cache and 16-bit q the FP8 tiles meet q
    and p as fp16: e4m3 -> fp16 is one conversion a pair of values on sm_90, -> bf16 two
    more a value (NOTES e36). q is scaled first (into fp16's range, clamped: never inf);
    both conversions of q are exact but for that one rounding to fp16's 11 bits."""
    if KV_FP8:
        if KV_F16:
            q = tl.clamp(q.to(tl.float32) * scale_log2e, -65504.0, 65504.0).to(tl.float16)
    return q


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    pos_ptr,
    k_new_ptr,
    v_new_ptr,
    cos_sin_ptr,
    slot_ptr,
    scale_log2e,
    num_seqs,
    num_heads,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    stride_kblk,
    stride_ktok,
    stride_khead,
    stride_nb,
    stride_nh,
    stride_vnb,
    stride_vnh,
    stride_c,
    max_position,
    num_slots,
    QG: tl.constexpr,
    QG_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_F16: tl.constexpr,
    ROPE: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b, mask=b < num_seqs, other=0)
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = s * per_split
        end = tl.minimum(start + per_split, seq_len)
    else:
        start = 0
        end = seq_len

    offs_g = tl.arange(0, QG_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = g * QG + offs_g
    row_mask = offs_g < QG
    d_mask = offs_d < HEAD_DIM
    q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_at + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = scale_log2e
    if KV_FP8:
        if KV_F16:
            qk_scale = tl.load(k_scale_ptr)
        else:
            qk_scale = qk_scale * tl.load(k_scale_ptr)
    loop_end = end
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        live = b < num_seqs
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        # every load that does not need the position first: they are in flight together
        pos = tl.load(pos_ptr + b, mask=live, other=-1).to(tl.int64)
        slot = tl.load(slot_ptr + b, mask=live, other=-1).to(tl.int64)
        qp = tl.load(q_at + partner[None, :], mask=row_mask[:, None], other=0.0)
        k_at = k_new_ptr + b * stride_nb + g * stride_nh
        kx = tl.load(k_at + offs_d, mask=live, other=0.0).to(tl.float32)
        kp = tl.load(k_at + partner, mask=live, other=0.0).to(tl.float32)
        v_new = tl.load(v_new_ptr + b * stride_vnb + g * stride_vnh + offs_d, mask=live,
                        other=0.0)
        rot = (pos >= 0) & (pos < max_position) & live
        cs_at = cos_sin_ptr + pos * stride_c + offs_d % HALF
        newest = seq_len - 1
        writes = (slot >= 0) & (slot < num_slots) & live & (newest >= start) & (newest < end)
        if ROPE == 1:  # rotate q, write the newest k and v, then the loop reads them back
            cos = tl.load(cs_at, mask=rot, other=0.0).to(tl.float32)
            sin = tl.load(cs_at + HALF, mask=rot, other=0.0).to(tl.float32)
            q = _rotate_q(q, qp, cos, sin, first, rot)
            _write_newest_kv(kx, kp, v_new, cos, sin, first, rot, slot, writes, g, k_cache_ptr,
                             v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_kblk, stride_ktok,
                             stride_khead, offs_d, k_new_ptr.dtype.element_ty, BLOCK_SIZE,
                             KV_FP8)
            tl.debug_barrier()  # the stores are seen by the program's other threads below
        else:  # the loop stops before the newest token; its term is added from registers
            loop_end = tl.where(writes, newest, end)
    if ROPE != 2:
        q_op = _q_operand(q, scale_log2e, KV_FP8, KV_F16)

    m_i = tl.full([QG_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QG_PAD], tl.float32)
    acc = tl.zeros([QG_PAD, HEAD_DIM], tl.float32)
    kv_head_off = g * stride_khead
    for tok0 in range(start, loop_end, BLOCK_N):
        offs_n = tok0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < loop_end
        blk = tl.load(
            block_tables_ptr + b * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0
        ).to(tl.int64)
        tok_off = blk * stride_kblk + (offs_n % BLOCK_SIZE) * stride_ktok + kv_head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if ROPE == 2:
            # q is rotated here, not before the loop: its cos/sin (an address tied to the
            # loop, so not hoisted) are then loaded after the first tile's table and K
            # loads are issued, and their wait overlaps those instead of preceding them
            at_tok = cs_at + tl.minimum(tok0 - start, 0)
            cos = tl.load(at_tok, mask=rot, other=0.0).to(tl.float32)
            sin = tl.load(at_tok + HALF, mask=rot, other=0.0).to(tl.float32)
            q_op = _q_operand(_rotate_q(q, qp, cos, sin, first, rot), scale_log2e, KV_FP8,
                              KV_F16)
        if KV_FP8:
            k = k.to(q_op.dtype)
        scores = tl.dot(q_op, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(m_i, l_i, scores)
        v = tl.load(v_cache_ptr + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q_op.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)

    if ROPE == 2:
        if writes:  # the program whose chunk holds the newest token
            cos = tl.load(cs_at, mask=rot, other=0.0).to(tl.float32)
            sin = tl.load(cs_at + HALF, mask=rot, other=0.0).to(tl.float32)
            q_op = _q_operand(_rotate_q(q, qp, cos, sin, first, rot), scale_log2e, KV_FP8,
                              KV_F16)
            k_c, v_c = _write_newest_kv(kx, kp, v_new, cos, sin, first, rot, slot, writes, g,
                                        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                        stride_kblk, stride_ktok, stride_khead, offs_d,
                                        k_new_ptr.dtype.element_ty, BLOCK_SIZE, KV_FP8)
            # its term, as the loop would have added it: the cached values in the
            # operands' dtype, products in fp32, p rounded to v's dtype
            kq = k_c.to(q_op.dtype).to(tl.float32)
            vq = v_c.to(q_op.dtype)
            s_new = tl.sum(q_op.to(tl.float32) * kq[None, :], 1) * qk_scale
            m_i, alpha, p, l_i = online_softmax(m_i, l_i, s_new[:, None])  # a block of 1
            p_v = p.to(vq.dtype).to(tl.float32)
            acc = acc * alpha[:, None] + p_v * vq.to(tl.float32)[None, :]

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    out_mask = row_mask[:, None] & d_mask[None, :]
    if SPLIT:
        part = (b * num_heads + heads) * NUM_SPLITS + s
        tl.store(m_ptr + part, m_i, mask=row_mask)
        tl.store(l_ptr + part, l_i, mask=row_mask)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
    else:
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        o = tl.where(l_i[:, None] > 0, acc / safe_l[:, None], 0.0)
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_seqs"])
def _split_reduce_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    num_seqs,
    num_heads,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = (offs_s < NUM_SPLITS) & (b < num_seqs)
    d_mask = offs_d < HEAD_DIM
    part = (b * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(m_ptr + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_max = tl.max(m, 0)
    has = m > float("-inf")
    w = tl.where(has, tl.exp2(tl.where(has, m, 0.0) - tl.where(has, m_max, 0.0)), 0.0)
    den = tl.sum(w * l_s, 0)
    num = tl.sum(w[:, None] * acc, 0)
    o = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=d_mask & (b < num_seqs),
    )


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("expected q [B, Hq, D] and k_cache, v_cache [blocks, block_size, Hkv, D]")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError("block_tables must be [B, max_blocks_per_seq]")
    if seq_lens.shape != (q.shape[0],):
        raise ValueError("seq_lens must be [B]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    check_cache_dtype(q, k_cache, v_cache, k_scale, v_scale)


def check_cache_dtype(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """The cache holds q's dtype, or FP8 with both scales given."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype}, {v_cache.dtype}")
    if is_fp8(k_cache.dtype):
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale")
    elif q.dtype != k_cache.dtype:
        raise ValueError(f"q and cache dtypes differ: {q.dtype}, {k_cache.dtype}")


def dequantized(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``cache`` in fp32, times ``scale`` when it is FP8 (the references' view of a cache)."""
    return cache.float() * scale if is_fp8(cache.dtype) else cache.float()


class RopeWrite(NamedTuple):
    """A decode step's rotary embedding and KV write, for ``paged_decode_attention`` to
    do (``kernels.rope_kv_cache``'s layouts): ``positions [B]`` int64, the new ``k, v
    [B, Hk, D]`` (unrotated), ``cos_sin_cache [max_position, D]`` fp32, ``slot_mapping
    [B]`` int64 (< 0: not written)."""

    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    rope: RopeWrite | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache; returns ``out [B, Hq, D]`` (q's dtype).

    ``num_splits``: None chooses with :func:`choose_num_splits`, using ``max_seq_len`` (or,
    without it, the block table's capacity, so no device sync is needed). ``k_scale``,
    ``v_scale``: an FP8 cache's fp32 scales (``[]``). ``rope``: q is unrotated, and the
    step's rotary embedding and KV write are done here too (module doc).
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    if rope is not None:
        rope_kv_cache.check_rope_write(rope.positions, q, rope.k, rope.v, rope.cos_sin_cache,
                                       k_cache, v_cache, rope.slot_mapping, k_scale, v_scale)
        rotary.check_kernel_layout(q=q, k=rope.k, v=rope.v, cos_sin_cache=rope.cos_sin_cache)
    kv_fp8 = is_fp8(k_cache.dtype)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if not (is_power_of_2(head_dim) and head_dim >= 16 and is_power_of_2(block_size)):
        raise ValueError(
            f"head_dim ({head_dim}) and block_size ({block_size}) must be powers "
            "of two, head_dim >= 16"
        )
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.stride(2) != 1:
        raise ValueError("out must be [B, Hq, D] with a contiguous last dim")
    if batch == 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = choose_num_splits(batch, num_kv_heads, bound, num_sms(q.device))
    num_splits = max(1, int(num_splits))

    qg = num_heads // num_kv_heads
    split = num_splits > 1
    cfg = decode_config(head_dim, block_size, kv_fp8, split)
    if split:
        m_buf = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
    else:
        m_buf = l_buf = acc_buf = out  # unused placeholders
    if rope is None:  # placeholders: the kernel reads none of them without ROPE
        rope_mode = 0
        rope_ptrs, rope_sizes = (seq_lens, out, out, out, seq_lens), (0,) * 6
    else:  # see ROPE_BEFORE_LOOP, ROPE_IN_LOOP
        programs = batch * num_kv_heads * num_splits
        small = USE_ROPE_IN_LOOP and programs <= num_sms(q.device)
        rope_mode = ROPE_IN_LOOP if small else ROPE_BEFORE_LOOP
        rope_ptrs = (rope.positions, rope.k, rope.v, rope.cos_sin_cache, rope.slot_mapping)
        rope_sizes = (*rope.k.stride()[:2], *rope.v.stride()[:2],
                      rope.cos_sin_cache.stride(0), rope.cos_sin_cache.shape[0])
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        m_buf,
        l_buf,
        acc_buf,
        k_scale if kv_fp8 else out,
        v_scale if kv_fp8 else out,
        *rope_ptrs,
        scale * LOG2E,
        batch,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *rope_sizes,
        k_cache.shape[0] * k_cache.shape[1],
        QG=qg,
        QG_PAD=max(16, next_power_of_2(qg)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=cfg["BLOCK_N"],
        NUM_SPLITS=num_splits,
        SPLIT=split,
        DOT_PREC=dot_precision(q.dtype),
        KV_FP8=kv_fp8,
        KV_F16=kv_fp8 and q.dtype in (torch.float16, torch.bfloat16),
        ROPE=rope_mode,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split:
        _split_reduce_kernel[(batch, num_heads)](
            m_buf,
            l_buf,
            acc_buf,
            out,
            batch,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=max(2, next_power_of_2(num_splits)),
            num_warps=4,
        )
    return out


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, Hkv, D]``: one sequence's tokens, read through its block table row."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:seq_len]


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference (fp32 softmax); ``num_splits``/``max_seq_len`` are ignored."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        k = dequantized(gather_kv(k_cache, block_tables[b], seq_len), k_scale)
        v = dequantized(gather_kv(v_cache, block_tables[b], seq_len), v_scale)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v).to(out.dtype)
    return out
