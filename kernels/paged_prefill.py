"""Paged prefill attention: variable-length query chunks, causal, K/V read from the paged cache.

Layouts:
    q:               ``[T, num_heads, head_dim]`` fp16 / bf16 / fp32 (last dim contiguous), the
                     new tokens of B sequences flattened in sequence order
    k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, q's dtype
                     or FP8 (E4M3) with per-layer fp32 ``k_scale``/``v_scale`` (``[]`` tensors)
    query_start_loc: ``[B+1]`` int32 cumulative new-token offsets into q
    seq_lens:        ``[B]`` int32 tokens of each sequence in the cache (earlier context + new)
    block_tables:    ``[B, max_blocks_per_seq]`` int32; entries past a sequence's blocks unread
    out:             ``[T, num_heads, head_dim]`` in q's dtype

The query tokens of sequence b are the last ``query_len_b`` of its ``seq_lens[b]`` tokens; the
query at absolute position p attends to cache positions 0..p. The new K/V must already be in
the cache. Query-length-1 rows (decode) are fine, so mixed batches can use this kernel.

Tiling (flash-attention): one program per (query tile, kv head); the grid is flat over all
sequences' query tiles (each program finds its sequence by binary search over
``query_start_loc``), so short and decode rows waste no programs. A tile holds
``BLOCK_M`` rows = ``BLOCK_M // group`` query tokens x the ``group`` query heads sharing the
kv head, so each K/V tile is loaded once per group. A sequence of a few new tokens (a
decode row of a mixed batch, a speculative verify row) would fill 4 rows of a 256-row
prefill tile and compute all 256 over its whole context: sequences of at most
``short_query`` new tokens run in a second launch of the same kernel with 16-row tiles
(``short_config``), each launch skipping the other's sequences. KV tiles of ``BLOCK_N``
tokens are gathered through the block table; tiles entirely visible to every row skip the
causal mask and tiles entirely in the future are never visited. Softmax statistics and
accumulators are fp32; ``tl.dot`` takes operands in the storage dtype (fp32 operands use
IEEE precision). ``head_dim`` and ``block_size`` must be powers of two (head_dim >= 16).
An FP8 cache is upcast to q's dtype in registers; ``k_scale`` joins the score scale,
``v_scale`` the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import dot_precision, is_interpreter, is_power_of_2, next_power_of_2
from kvscale.kernels.fp8 import is_fp8
from kvscale.kernels.paged_decode import (
    check_cache_dtype,
    dequantized,
    gather_kv,
    online_softmax,
)

LOG2E = 1.4426950408889634


def prefill_config(head_dim: int, group: int, elem_bytes: int = 2) -> dict[str, int]:
    """Tile sizes and launch options: Hopper defaults on CUDA, small tiles when interpreting.

    ``elem_bytes`` 4 (fp32) halves the tiles so they fit in shared memory."""
    if is_interpreter():
        return {
            "BLOCK_M": max(32, next_power_of_2(group)),
            "BLOCK_N": 16,
            "num_warps": 4,
            "num_stages": 1,
        }
    if head_dim <= 128 and elem_bytes <= 2:
        block_m, block_n, warps, stages = 256, 64, 8, 4  # tuned on H100 (bench/NOTES.md)
    elif head_dim <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 2
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    return {
        "BLOCK_M": max(block_m, next_power_of_2(group)),
        "BLOCK_N": block_n,
        "num_warps": warps,
        "num_stages": stages,
    }


def short_config(head_dim: int, group: int, elem_bytes: int = 2) -> dict[str, int]:
    """Tile sizes and launch options for sequences of few new tokens: 16-row tiles (the
    smallest ``tl.dot`` takes), so a decode row's tile holds its ``group`` query heads."""
    block_m = max(16, next_power_of_2(group))
    if is_interpreter():
        return {"BLOCK_M": block_m, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    block_n = 128 if head_dim <= 128 and elem_bytes <= 2 else 32  # tuned on H100 (NOTES e26)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 2}


SHORT_QUERY = 16  # sequences of at most this many new tokens run in 16-row tiles
_NO_LIMIT = 2**31 - 1


@triton.jit
def _attn_tiles(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,
    kv_head_off,
    stride_kblk,
    stride_ktok,
    lo,
    hi,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    scale_log2e,
):
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM
    for tok0 in range(lo, hi, BLOCK_N):
        offs_n = tok0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok_off = blk * stride_kblk + (offs_n % BLOCK_SIZE) * stride_ktok + kv_head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2e
        if CAUSAL:
            visible = offs_n[None, :] <= q_pos[:, None]
            scores = tl.where(visible, scores, float("-inf"))
        m_i, alpha, p, l_i = online_softmax(m_i, l_i, scores)
        v = tl.load(v_cache_ptr + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_i


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Last sequence b whose first query tile ``query_start_loc[b] // BLOCK_Q + b`` <= tile."""
    lo = tl.program_id(0) * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid, mask=mid < num_seqs, other=0) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "min_q_len", "max_q_len"])
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2e,
    num_seqs,
    min_q_len,
    max_q_len,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_kblk,
    stride_ktok,
    stride_khead,
    QG: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Flat grid over query tiles: sequence b owns tiles [qsl[b] // BLOCK_Q + b, ...), at
    # least cdiv(query_len_b, BLOCK_Q) of them, so decode rows cost one program per kv head.
    tile = tl.program_id(0)
    g = tl.program_id(1)
    b = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    seq_ok = (b >= 0) & (b < num_seqs)
    q_start = tl.load(query_start_loc_ptr + b, mask=seq_ok, other=0)
    q_end = tl.load(query_start_loc_ptr + b + 1, mask=seq_ok, other=0)
    q_len = q_end - q_start
    q_tile0 = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q
    # past the sequence's queries, or a sequence the other launch runs
    if (q_tile0 >= q_len) | (q_len < min_q_len) | (q_len > max_q_len):
        return
    seq_len = tl.load(seq_lens_ptr + b, mask=seq_ok, other=0)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM
    tok = offs_m // QG
    heads = g * QG + offs_m % QG
    q_idx = q_tile0 + tok
    row_mask = (tok < BLOCK_Q) & (q_idx < q_len)
    # Padding rows take the tile's last position so every row sees >= 1 key (no NaN).
    q_pos = ctx_len + tl.minimum(q_idx, q_len - 1)
    q_rows = (q_start + q_idx).to(tl.int64)
    mask2 = row_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask2,
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if KV_FP8:
        scale_log2e = scale_log2e * tl.load(k_scale_ptr)
    bt_row_ptr = block_tables_ptr + b * stride_bt
    kv_head_off = g * stride_khead
    first_pos = ctx_len + q_tile0
    kv_end = ctx_len + tl.minimum(q_tile0 + BLOCK_Q, q_len)
    # Keys [0, full_end) are visible to every row of the tile: no causal mask there.
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attn_tiles(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        bt_row_ptr,
        kv_head_off,
        stride_kblk,
        stride_ktok,
        0,
        full_end,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_N,
        False,
        DOT_PREC,
        KV_FP8,
        scale_log2e,
    )
    acc, l_i, m_i = _attn_tiles(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        k_cache_ptr,
        v_cache_ptr,
        bt_row_ptr,
        kv_head_off,
        stride_kblk,
        stride_ktok,
        full_end,
        kv_end,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_N,
        True,
        DOT_PREC,
        KV_FP8,
        scale_log2e,
    )
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask2,
    )


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("expected q [T, Hq, D] and k_cache, v_cache [blocks, block_size, Hkv, D]")
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,):
        raise ValueError("query_start_loc must be [B+1]")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError("block_tables must be [B, max_blocks_per_seq]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    check_cache_dtype(q, k_cache, v_cache, k_scale, v_scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    short_query: int = SHORT_QUERY,
) -> torch.Tensor:
    """Causal attention of each new token to its sequence's cached tokens; ``out [T, Hq, D]``.

    ``max_query_len`` (host int, >= every query length) skips empty batches and picks the
    launches: the grids are flat over query tiles, sized from T and B without a device
    sync. Sequences of at most ``short_query`` new tokens run in small tiles, the others
    in large ones (0: every sequence in large tiles, one launch).
    ``k_scale``, ``v_scale``: an FP8 cache's fp32 scales (``[]``).
    """
    _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, k_scale, v_scale)
    kv_fp8 = is_fp8(k_cache.dtype)
    num_heads, head_dim = q.shape[1:]
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
        raise ValueError("out must be [T, Hq, D] with a contiguous last dim")
    batch = seq_lens.shape[0]
    if batch == 0 or q.shape[0] == 0 or max_query_len <= 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    qg = num_heads // num_kv_heads
    scales = (k_scale, v_scale) if kv_fp8 else (out, out)
    args = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, *scales,
            scale * LOG2E, batch)  # fmt: skip
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))  # fmt: skip
    launches = _launches(
        q.shape[0], batch, max_query_len, short_query, head_dim, qg, q.element_size()
    )
    for cfg, min_q_len, max_q_len in launches:
        block_q = cfg["BLOCK_M"] // qg
        grid = (triton.cdiv(q.shape[0], block_q) + batch, num_kv_heads)
        _paged_prefill_kernel[grid](
            *args,
            min_q_len,
            max_q_len,
            *strides,
            QG=qg,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_Q=block_q,
            BLOCK_N=cfg["BLOCK_N"],
            DOT_PREC=dot_precision(q.dtype),
            KV_FP8=kv_fp8,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    return out


def _launches(
    num_tokens: int,
    batch: int,
    max_query_len: int,
    short_query: int,
    head_dim: int,
    group: int,
    elem_bytes: int,
) -> list[tuple[dict[str, int], int, int]]:
    """``(config, min query length, max query length)`` of each launch a batch of
    ``num_tokens`` new tokens over ``batch`` sequences needs."""
    if 0 < max_query_len <= short_query:
        return [(short_config(head_dim, group, elem_bytes), 0, _NO_LIMIT)]
    big = prefill_config(head_dim, group, elem_bytes)
    # short_query 0, or every sequence has max_query_len tokens: the large tiles only
    if short_query <= 0 or num_tokens == batch * max_query_len:
        return [(big, 0, _NO_LIMIT)]
    return [(big, short_query + 1, _NO_LIMIT), (short_config(head_dim, group, elem_bytes), 0,
                                                short_query)]  # fmt: skip


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference: gathers each sequence's K/V, masked softmax in fp32."""
    _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, k_scale, v_scale)
    group = q.shape[1] // k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        k = dequantized(gather_kv(k_cache, block_tables[b], seq_len), k_scale)
        v = dequantized(gather_kv(v_cache, block_tables[b], seq_len), v_scale)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
