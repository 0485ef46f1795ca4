"""W4A16 GEMM: 16-bit activations times 4-bit weights, dequantized in registers.

One weight layout serves every 4-bit checkpoint format (AWQ, GPTQ, compressed-tensors
``pack-quantized``): the linear methods repack into it once, at load.

Layout (``K`` input features, ``N`` output features, ``G`` groups):
    x:        ``[M, K]`` fp16 / bf16 / fp32 (or ``[..., K]``; last dim contiguous)
    qweight:  ``[ceil(K/8), N]`` int32; bits ``4j..4j+3`` of ``qweight[r, n]`` hold the
              unsigned code (0..15) of weight row ``k = 8r + j``, column ``n``
    scales:   ``[G, N]`` float (fp32 as the methods store them; any float dtype works)
    zeros:    ``[G, N]`` uint8 zero points (0..15), or None: symmetric, every zero is 8
    group_size: rows per group; row ``k`` is in group ``k // group_size``, or in
              ``g_idx[k]`` when ``g_idx`` (``[K]`` int32) is given (act-order checkpoints
              whose rows, once sorted by group, do not form equal contiguous groups)
    perm:     ``[K]`` int32 or None: weight row ``k`` multiplies activation column
              ``perm[k]`` (act-order: rows are stored sorted by group)
    out:      ``[M, N]`` in x's dtype

    w[k, n] = (code[k, n] - zero[g(k), n]) * scale[g(k), n]    (fp32, then x's dtype;
              the kernel computes code * scale - zero * scale: one FMA per weight)
    out = x[:, perm] @ w                                        (fp32 accumulation)

The kernel loads a ``[BLOCK_K/8, BLOCK_N]`` tile of packed words, shifts out the eight
nibbles of each word into a ``[BLOCK_K, BLOCK_N]`` tile, applies the group's zero point
and scale, rounds to the activation dtype and feeds ``tl.dot``. Decode-sized batches use
split-K (each program sums a slice of K into an fp32 partial; the last program of each
output tile to finish adds the slices and casts), so that a few output tiles still
occupy every SM; prefill-sized batches use larger tiles and no split. A single row
(batch-1 decode) with whole groups per K tile takes a GEMV kernel instead: no ``tl.dot``
(whose 16-row minimum would waste 15 of 16 rows), each program multiplying codes by the
activations and reducing over K, with one scale and zero point per column and tile:
``sum_k (c s + z') x = s sum_k c x + z' sum_k x``. :func:`w4a16_config` picks the kernel,
tiles and splits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvscale.kernels._utils import (
    MAX_ARRIVAL_COUNTERS,
    arrival_counters,
    dot_precision,
    is_interpreter,
    num_sms,
)

PACK = 8  # 4-bit codes per int32
SYMMETRIC_ZERO = 8
ONE_GROUP = 1 << 30  # group size standing for "one group spans all of K"
TARGET_PROGRAMS_PER_SM = 4  # split-K aims for this many programs per SM
GEMV_PROGRAMS_PER_SM = 3  # the GEMV takes 256 rows of K a program if that leaves this many
GEMV_BLOCK_KS = (128, 64)  # the GEMV's K tile: the first that the groups allow
MAX_SPLIT_K = 16

# how a K tile finds its groups (the GROUP_MODE constexpr)
TILE = 0  # the whole tile lies in one group
MULTI = 1  # the tile holds BLOCK_K // group_size whole groups
ROW = 2  # each row looks its group up (g_idx, or group sizes that do not tile)


# ---- the layout ------------------------------------------------------------------------
def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """``[K, N]`` codes (0..15, any integer dtype) -> ``[ceil(K/8), N]`` int32, row
    ``8r + j`` in bits ``4j..4j+3`` of word row ``r`` (rows past K are zero). One nibble
    at a time: no intermediate larger than the output (checkpoints load on the GPU)."""
    k, n = codes.shape
    rows = -(-k // PACK)
    words = torch.zeros(rows, n, dtype=torch.int32, device=codes.device)
    for j in range(PACK):
        part = codes[j::PACK].to(torch.int32) & 0xF  # rows j, j+8, ... of the K rows
        words[: part.shape[0]] |= part << (4 * j)
    return words


def unpack_int4_rows(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_rows`: ``[ceil(K/8), N]`` int32 -> ``[K, N]`` uint8."""
    rows, n = qweight.shape
    codes = torch.empty(rows, PACK, n, dtype=torch.uint8, device=qweight.device)
    for j in range(PACK):
        codes[:, j] = ((qweight >> (4 * j)) & 0xF).to(torch.uint8)
    return codes.view(rows * PACK, n)[:k]


def dequantize_w4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    k: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``[K, N]`` in fp32, rows in storage order (``perm`` not applied)."""
    n = qweight.shape[1]
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32).view(1, PACK, 1)
    codes = ((qweight.unsqueeze(1) >> shifts) & 0xF).reshape(-1, n).float()  # [8*rows, N]
    s = scales.float()
    z = zeros.float() if zeros is not None else torch.full_like(s, SYMMETRIC_ZERO)
    if g_idx is not None:
        rows = g_idx.long()
        return (codes[:k] - z[rows]) * s[rows]
    # contiguous groups: broadcast each group's row over its rows (no [K, N] gathers)
    size = min(group_size, k)
    groups = -(-k // size)
    if codes.shape[0] < groups * size:
        codes = F.pad(codes, (0, 0, 0, groups * size - codes.shape[0]))
    w = (codes[: groups * size].view(groups, size, n) - z[:, None]) * s[:, None]
    return w.view(groups * size, n)[:k]


def _check(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> tuple[int, int, int]:
    m, k = x2.shape
    n = qweight.shape[1]
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t is not None and t.dim() == 2 and t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    if qweight.dtype != torch.int32 or qweight.shape[0] != -(-k // PACK):
        raise ValueError(
            f"qweight must be int32 [{-(-k // PACK)}, N] for K={k}, got "
            f"{qweight.dtype} {tuple(qweight.shape)}"
        )
    groups = scales.shape[0]
    if scales.shape[1] != n or (g_idx is None and groups != -(-k // min(group_size, k))):
        raise ValueError(
            f"scales must be [groups, {n}] with groups = ceil(K / group_size) = "
            f"{-(-k // min(group_size, k))}, got {tuple(scales.shape)}"
        )
    if zeros is not None and (zeros.dtype != torch.uint8 or zeros.shape != scales.shape):
        raise ValueError(f"zeros must be uint8 {tuple(scales.shape)}, got {zeros.dtype}")
    for name, t in (("perm", perm), ("g_idx", g_idx)):
        if t is not None and (t.shape != (k,) or t.dtype != torch.int32):
            raise ValueError(f"{name} must be int32 [{k}], got {t.dtype} {tuple(t.shape)}")
    return m, n, k


def w4a16_gemm_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """Pure-torch reference and CPU path: the weight dequantized in fp32, rounded to x's
    dtype, multiplied with fp32 accumulation. ``config`` is ignored (same signature)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    _check(x2, qweight, scales, zeros, group_size, perm, g_idx)
    w = dequantize_w4(qweight, scales, zeros, group_size, k, g_idx).to(x.dtype)
    if perm is not None:
        x2 = x2[:, perm.long()]
    out = (x2.float() @ w.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], qweight.shape[1])


# ---- tiles and splits ------------------------------------------------------------------
def w4a16_config(
    m: int, n: int, k: int, device: torch.device, gemv_block_k: int | None = GEMV_BLOCK_KS[0]
) -> dict[str, int]:
    """Tiles, split-K and launch options for an ``[m, k] x [k, n]`` product.

    One row takes the GEMV kernel (``GEMV: 1``) where its groups allow a K tile
    (``gemv_block_k``: see :func:`gemv_block_k`; None: they do not): 256 columns a tile,
    2 warps, K split so that each program takes 256 rows of K where that still leaves
    ``GEMV_PROGRAMS_PER_SM`` programs an SM, else 128 (leases r22-r24's sweeps at the 8B
    shapes, NOTES e33 and e37: in 128-row tiles where the groups allow, 5-10% faster
    than in 64-row ones). Other decode-sized
    batches (``m <= 64``) take 16/32/64-row tiles, split until there are about
    ``TARGET_PROGRAMS_PER_SM`` programs per SM (each split at least one K tile); larger
    batches take 128 x 128 tiles, split only while the output tiles alone leave SMs idle.
    Small tiles under the Triton interpreter. ``bench/kernels.py`` sweeps alternatives
    at the 8B model's shapes.
    """
    sms = num_sms(device)
    if m == 1 and gemv_block_k is not None:
        block_n, block_k = (32, 32) if is_interpreter() else (256, gemv_block_k)
        columns = triton.cdiv(n, block_n)
        per = 256 if columns * triton.cdiv(k, 256) >= GEMV_PROGRAMS_PER_SM * sms else 128
        split = max(1, triton.cdiv(k, max(per, block_k)))
        return {"GEMV": 1, "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k,
                "SPLIT_K": split, "num_warps": 2, "num_stages": 1}  # fmt: skip
    if is_interpreter():
        cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    elif m <= 64:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n = 64 if n <= 8192 else 128
        cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 128, "num_warps": 4}
        cfg["num_stages"] = 4
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    tiles = triton.cdiv(max(m, 1), cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    k_tiles = triton.cdiv(k, cfg["BLOCK_K"])
    split = 1
    if tiles < sms:
        split = max(1, min(TARGET_PROGRAMS_PER_SM * sms // tiles, k_tiles, MAX_SPLIT_K))
    cfg["SPLIT_K"] = split
    return cfg


def gemv_block_k(group_size: int, groups: int, has_g_idx: bool) -> int | None:
    """The GEMV's K tile for these groups: the first of ``GEMV_BLOCK_KS`` whose every
    tile lies in one group (32 under the interpreter); None where none does."""
    sizes = (32,) if is_interpreter() else GEMV_BLOCK_KS
    return next((b for b in sizes if gemv_fits(group_size, groups, b, has_g_idx)), None)


def _split_plan(k: int, block_k: int, split: int) -> tuple[int, int]:
    """(K per split, rounded up to whole tiles; number of non-empty splits)."""
    k_tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(k_tiles, max(1, min(split, k_tiles))) * block_k
    return per, triton.cdiv(k, per)


def _group_mode(group_size: int, groups: int, block_k: int, has_g_idx: bool) -> tuple[int, int]:
    """(GROUP_MODE, the GROUP_SIZE constexpr) for a K tile of ``block_k`` rows."""
    if has_g_idx:
        return ROW, 1
    if groups == 1:
        return TILE, ONE_GROUP
    if group_size % block_k == 0:
        return TILE, group_size
    if block_k % group_size == 0:
        return MULTI, group_size
    return ROW, group_size


# ---- kernels ---------------------------------------------------------------------------
@triton.jit
def _tile_rows(perm_ptr, k0, k_end, BLOCK_K: tl.constexpr, HAS_PERM: tl.constexpr):
    """The K tile at ``k0``: its weight rows' mask (rows ``< k_end``) and the activation
    columns they multiply (``perm[k]`` for act-order weights, else ``k``)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < k_end
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        cols = offs_k
    return k_mask, cols


@triton.jit
def _unpack_tile(
    qw_ptr, k0, k_end, offs_n, n_mask, stride_qk, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Codes of rows ``k0 .. k0 + BLOCK_K - 1`` (zero past ``k_end``) and columns
    ``offs_n``: ``[BLOCK_K, BLOCK_N]`` fp32, from ``BLOCK_K / 8`` rows of packed words
    (each holds rows 8r .. 8r+7 of one column)."""
    offs_p = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    p_mask = offs_p * 8 < k_end
    words = tl.load(
        qw_ptr + offs_p[:, None].to(tl.int64) * stride_qk + offs_n[None, :],
        mask=p_mask[:, None] & n_mask[None, :],
        other=0,
    )
    codes = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    return tl.reshape(codes, (BLOCK_K, BLOCK_N)).to(tl.float32)


@triton.jit
def _group_scale(s_ptr, z_ptr, g, offs_n, n_mask, stride_sg, stride_zg, HAS_ZP: tl.constexpr):
    """Group ``g``'s scales ``s`` and ``-zero * s`` for columns ``offs_n`` (fp32
    ``[BLOCK_N]``): ``w = code * s + (-zero * s)``, one FMA a weight."""
    s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZP:
        z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0)
        zs = -z.to(tl.float32) * s
    else:
        zs = -8.0 * s
    return s, zs


@triton.jit
def _store_out(
    acc,
    c_ptr,
    p_ptr,
    lock_ptr,
    tile,
    split_idx,
    splits,
    c_off,
    c_mask,
    stride_cs,
    SPLIT: tl.constexpr,
    FIXUP: tl.constexpr,
):
    """Writes a program's fp32 ``acc`` (its split of K for output tile ``tile``).

    Unsplit: cast into ``c``. Split without ``FIXUP``: the partial into ``p`` (a second
    kernel sums them). Split with ``FIXUP``: the partial into ``p``, then a ticket from
    the tile's counter; the tile's last split to arrive sums every partial in split order
    (the same sum as the second kernel's) into ``c`` and resets the counter to 0 for the
    next launch: one kernel instead of two."""
    if not SPLIT:
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        tl.store(p_ptr + split_idx * stride_cs + c_off, acc, mask=c_mask)
        if FIXUP:
            tl.debug_barrier()  # every thread's partial is written before the release
            ticket = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            if ticket == splits - 1:
                tl.debug_barrier()
                total = tl.zeros_like(acc)
                # unrolled: the loads of several partials in flight at once, added in order
                for s in tl.range(0, splits, loop_unroll_factor=8):
                    total += tl.load(
                        p_ptr + s * stride_cs + c_off,
                        mask=c_mask,
                        other=0.0,
                        cache_modifier=".cg",  # other programs' partials: not from L1
                    )
                tl.store(c_ptr + c_off, total.to(c_ptr.dtype.element_ty), mask=c_mask)
                tl.atomic_xchg(lock_ptr + tile, 0)


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["M", "stride_cs"])
def _w4a16_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    gidx_ptr,
    c_ptr,
    p_ptr,
    lock_ptr,
    M,
    N,
    K,
    num_groups,
    k_per_split,
    stride_am,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_cs,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_MODE: tl.constexpr,
    TG: tl.constexpr,
    HAS_ZP: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_GIDX: tl.constexpr,
    SPLIT: tl.constexpr,
    FIXUP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Grouped tile order: GROUP_M row tiles share each weight column tile in L2.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_in_group
    pid_n = (pid % width) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask, cols = _tile_rows(perm_ptr, k0, k_end, BLOCK_K, HAS_PERM)
        a = tl.load(
            a_ptr + offs_m[:, None].to(tl.int64) * stride_am + cols[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        codes = _unpack_tile(qw_ptr, k0, k_end, offs_n, n_mask, stride_qk, BLOCK_K, BLOCK_N)

        # w = (code - zero) * scale, computed as one FMA: code * scale + (-zero * scale)
        if GROUP_MODE == 0:  # TILE: one scale (and zero) row for the whole tile
            s, zs = _group_scale(
                s_ptr, z_ptr, k0 // GROUP_SIZE, offs_n, n_mask, stride_sg, stride_zg, HAS_ZP
            )
            s = s[None, :]
            zs = zs[None, :]
        elif GROUP_MODE == 1:  # MULTI: TG = BLOCK_K // GROUP_SIZE whole groups
            g = k0 // GROUP_SIZE + tl.arange(0, TG)
            gm = (g < num_groups)[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=gm, other=0.0)
            s = s.to(tl.float32)
            if HAS_ZP:
                z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=gm, other=0)
                zs = -z.to(tl.float32) * s
            else:
                zs = -8.0 * s
            s = tl.broadcast_to(s[:, None, :], (TG, GROUP_SIZE, BLOCK_N))
            s = tl.reshape(s, (BLOCK_K, BLOCK_N))
            zs = tl.broadcast_to(zs[:, None, :], (TG, GROUP_SIZE, BLOCK_N))
            zs = tl.reshape(zs, (BLOCK_K, BLOCK_N))
        else:  # ROW: a group index per row
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if HAS_GIDX:
                g = tl.load(gidx_ptr + offs_k, mask=k_mask, other=0)
            else:
                g = offs_k // GROUP_SIZE
            gm = k_mask[:, None] & n_mask[None, :]
            s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :], mask=gm, other=0.0)
            s = s.to(tl.float32)
            if HAS_ZP:
                z = tl.load(z_ptr + g[:, None] * stride_zg + offs_n[None, :], mask=gm, other=0)
                zs = -z.to(tl.float32) * s
            else:
                zs = -8.0 * s
        w = codes * s + zs
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)

    c_mask = m_mask[:, None] & n_mask[None, :]
    c_off = offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    _store_out(
        acc,
        c_ptr,
        p_ptr,
        lock_ptr,
        pid,
        pid_k,
        tl.num_programs(1),
        c_off,
        c_mask,
        stride_cs,
        SPLIT,
        FIXUP,
    )


@triton.jit(do_not_specialize=["total"])
def _split_k_sum_kernel(p_ptr, out_ptr, total, splits, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["stride_cs"])
def _w4a16_gemv_kernel(
    a_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    c_ptr,
    p_ptr,
    lock_ptr,
    N,
    K,
    k_per_split,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_cs,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SPLIT: tl.constexpr,
    FIXUP: tl.constexpr,
    EVEN: tl.constexpr = 0,
):
    """One row: ``c[n] = sum_k x[k] w[k, n]``; every K tile lies in one group, so each
    tile adds ``s sum_k c x + z' sum_k x`` per column. The ``[BLOCK_K / 8, BLOCK_N]`` tile
    of words stays in the layout it was loaded in and nibble j of word row r multiplies
    activation ``8r + j``: with ``BLOCK_N = 128 * num_warps`` each thread holds four
    columns of every word row and the sums over K never leave its registers (no layout
    change through shared memory and no barrier in the loop). Against unpacking each
    tile into ``[BLOCK_K, BLOCK_N]`` codes for a reduction across threads, on an H100:
    gate_up 19% faster, the other 8B layers within 4% either way, int4 C 3.98 -> 3.66 ms
    (NOTES e33). ``EVEN`` (K and N whole tiles: the caller's): no masks in the loop.
    Zero points are always read (symmetric weights: from a row of 8s with a group stride
    of 0, see ``_symmetric_zero_row``).
    Tried and not kept: nibbles made floats from their bits with 2**23 instead of an
    int-to-float conversion, on the earlier GEMV (NOTES e18) and on this one with FFMA
    partial sums (e37: 2-9% slower at the median config, the best within 5%);
    prefetching the next tile's words (e18)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rows = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_p = k0 // 8 + rows
        p_mask = offs_p * 8 < k_end
        w_ptrs = qw_ptr + offs_p[:, None].to(tl.int64) * stride_qk + offs_n[None, :]
        if EVEN:  # every tile whole: no masks in the loop
            words = tl.load(w_ptrs)
        else:
            words = tl.load(w_ptrs, mask=p_mask[:, None] & n_mask[None, :], other=0)
        s, zs = _group_scale(
            s_ptr, z_ptr, k0 // GROUP_SIZE, offs_n, n_mask, stride_sg, stride_zg, True
        )
        a_sum = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(8):
            k = offs_p * 8 + j
            k_mask = k < k_end  # a last word may hold fewer than 8 rows
            if HAS_PERM:
                if EVEN:
                    cols = tl.load(perm_ptr + k)
                else:
                    cols = tl.load(perm_ptr + k, mask=k_mask, other=0)
            else:
                cols = k
            if EVEN:
                a = tl.load(a_ptr + cols).to(tl.float32)
            else:
                a = tl.load(a_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
            codes = ((words >> (4 * j)) & 0xF).to(tl.float32)
            dot += tl.sum(codes * a[:, None], axis=0)
            a_sum += a
        acc += s * dot + zs * tl.sum(a_sum, axis=0)
    _store_out(
        acc,
        c_ptr,
        p_ptr,
        lock_ptr,
        pid_n,
        pid_k,
        tl.num_programs(1),
        offs_n,
        n_mask,
        stride_cs,
        SPLIT,
        FIXUP,
    )


_SYMMETRIC_ZEROS: dict[torch.device, list[torch.Tensor]] = {}


def _symmetric_zero_row(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` uint8 zero points of 8, shared by every symmetric GEMV on the
    device, which reads them with a group stride of 0 (one row for every group): the
    GEMV's zero-point variant runs ~20% faster than its symmetric one in 128-row tiles
    (r27's sweep on an H100: 103.7 against 129.0 us an 8B layer; the same instructions
    and registers in their SASS, so the cause is not visible there), for a 256-byte
    load a program. Rows are never freed (CUDA graphs keep their addresses); a new one
    is made outside any capture (the first call of a shape runs eagerly)."""
    rows = _SYMMETRIC_ZEROS.setdefault(device, [])
    for row in rows:
        if row.numel() >= n:
            return row
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("w4a16: first call of this width inside a CUDA-graph capture")
    row = torch.full((max(n, 1 << 16),), SYMMETRIC_ZERO, dtype=torch.uint8, device=device)
    rows.append(row)
    return row


def gemv_fits(group_size: int, groups: int, block_k: int, has_g_idx: bool) -> bool:
    """Whether the GEMV kernel can run: every K tile of ``block_k`` rows in one group."""
    return _group_mode(group_size, groups, block_k, has_g_idx)[0] == TILE


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x [..., K]`` times the 4-bit weight (module docstring) -> ``[..., N]`` in x's
    dtype. ``config`` overrides :func:`w4a16_config` (BLOCK_M/N/K, SPLIT_K, num_warps,
    num_stages; benchmarks sweep it)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, _ = _check(x2, qweight, scales, zeros, group_size, perm, g_idx)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    if config is None:
        block_k = gemv_block_k(group_size, scales.shape[0], g_idx is not None)
        config = w4a16_config(m, n, k, x.device, gemv_block_k=block_k)
    cfg: dict[str, Any] = dict(config)
    block_k = cfg["BLOCK_K"]
    if block_k % PACK or block_k < 16:
        raise ValueError(f"BLOCK_K must be a multiple of 8 and >= 16, got {block_k}")
    per_split, splits = _split_plan(k, block_k, cfg.pop("SPLIT_K", 1))
    mode, gs = _group_mode(group_size, scales.shape[0], block_k, g_idx is not None)
    gemv = bool(cfg.pop("GEMV", 0))
    if gemv and (m != 1 or mode != TILE):
        raise ValueError(f"GEMV needs one row and whole groups per K tile (M={m}, {cfg})")
    split = splits > 1
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if split else out
    grid = (
        triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),
        splits,
    )
    want_fixup = bool(cfg.pop("FIXUP", 1))
    fixup = split and want_fixup and grid[0] <= MAX_ARRIVAL_COUNTERS
    dummy = qweight  # stands in for absent optional tensors (never read)
    locks = arrival_counters(x.device) if fixup else dummy
    if gemv:
        del cfg["BLOCK_M"]
        if zeros is None:  # symmetric: 8s from a shared row (see _symmetric_zero_row)
            z_arg, stride_zg = _symmetric_zero_row(x.device, n), 0
        else:
            z_arg, stride_zg = zeros, zeros.stride(0)
        _w4a16_gemv_kernel[grid](
            x2,
            qweight,
            scales,
            z_arg,
            perm if perm is not None else dummy,
            out,
            partial,
            locks,
            n,
            k,
            per_split,
            qweight.stride(0),
            scales.stride(0),
            stride_zg,
            n,
            GROUP_SIZE=gs,
            HAS_PERM=perm is not None,
            SPLIT=split,
            FIXUP=fixup,
            EVEN=k % block_k == 0 and n % cfg["BLOCK_N"] == 0,
            **cfg,
        )
    else:
        _w4a16_kernel[grid](
            x2,
            qweight,
            scales,
            zeros if zeros is not None else dummy,
            perm if perm is not None else dummy,
            g_idx if g_idx is not None else dummy,
            out,
            partial,
            locks,
            m,
            n,
            k,
            scales.shape[0],
            per_split,
            x2.stride(0),
            qweight.stride(0),
            scales.stride(0),
            zeros.stride(0) if zeros is not None else 0,
            m * n,
            n,
            GROUP_M=8,
            GROUP_SIZE=gs,
            GROUP_MODE=mode,
            TG=block_k // gs if mode == MULTI else 1,
            HAS_ZP=zeros is not None,
            HAS_PERM=perm is not None,
            HAS_GIDX=g_idx is not None,
            SPLIT=split,
            FIXUP=fixup,
            DOT_PREC=dot_precision(x.dtype),
            **cfg,
        )
    if split and not fixup:
        total = m * n
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(total, block),)](
            partial, out, total, splits, BLOCK=block, num_warps=4
        )
    return out.reshape(*x.shape[:-1], n)
