"""W4A16 products of few rows on tensor-core tiles, the nibbles turned into 16-bit values
two at a time. Not used by the engine: on an H100 it took 1.2-2.6x tinygemm's time at 1-4
rows; at 16 rows it beat both other int4 kernels on three of the four 8B layers (r107,
NOTES "e99 measured", which also says what to try next).

Layouts (the codes as in ``kvscale.kernels.w4a16``):
    x:       ``[M, K]`` fp16 or bf16
    words:   ``[N, ceil(K/8)]`` int32, ``w4a16``'s ``qweight`` transposed with each
             word's nibbles reordered (:func:`transpose_words`): bits ``4q..4q+3`` of
             ``words[n, r]`` hold the code of weight row ``k = 8r + NIBBLE_ROWS[q]``
    scales:  ``[G, N]`` float; ``zeros``: ``[G, N]`` uint8 or None (every zero 8); row
             ``k`` is in group ``k // group_size`` (contiguous groups, no act-order)
    out:     ``[M, N]`` in x's dtype: ``x @ ((code - zero) * scale)``

Why: the W4A16 kernels dequantize each weight in fp32 (shift, mask, convert, FMA, round,
a 16-bit shared-memory store each: their 16-row tile loop compiles to ~9.6 instructions
a weight for sm_90, ~11.6 with zero points, counted as below) where an H100 moving int4
weights at 85% of its bandwidth leaves an SM ~5.8 instructions a weight in all. Here one
``lop3`` a word and shift ORs two nibbles into the mantissa of 1024 (fp16) or 128
(bf16): exactly ``1024 + code``. Then ``(h - (1024 + zero)) * scale`` (the subtraction
exact) on 16-bit pairs: ~3.4-4.1 instructions a weight in all compiled for sm_90 (the
loop's growth from 128 to 256 rows of K a step). With zero points the unpacked tile
reaches the MMA in registers; without, Triton passes it through shared memory (NOTES "e99
measured"). Each ``lop3`` result holds rows ``(k, k + 1)`` of a word
(the order ``transpose_words`` stores), as the MMA takes them from one register. Under
the Triton interpreter (no inline PTX) shifts and adds give the same values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import is_interpreter, is_power_of_2
from kvscale.kernels.tile_mm import TileConfig
from kvscale.kernels.w4a16 import PACK

INTERPRETER_CONFIG = TileConfig(16, 32, 64, num_warps=4, num_stages=1)  # 128 rows of K
DEFAULT_CONFIG = TileConfig(16, 64, 128, num_warps=4, num_stages=4, tma=True)  # 256 rows


def block_k(cfg: TileConfig) -> int:
    """Rows of K a step: ``block_k_bytes`` of packed codes (two a byte)."""
    return cfg.block_k_bytes * 2


@triton.jit
def _nibble_pair(words, SHIFT: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """Nibbles ``SHIFT / 4`` and ``SHIFT / 4 + 4`` of each word as 16-bit floats holding
    ``OFFSET + code`` (OFFSET 1024 in fp16, 128 in bf16)."""
    if ASM:
        # 0x4300 is bf16's 128, 0x6400 fp16's 1024: the nibble lands in the mantissa
        dtype = tl.bfloat16 if BF16 else tl.float16
        lo, hi = tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t;
            shr.u32 t, $2, {SHIFT};
            lop3.b32 t, t, 0x000F000F, {"0x43004300" if BF16 else "0x64006400"}, 0xea;
            mov.b32 {{$0, $1}}, t;
            }}""",
            constraints="=h,=h,r",
            args=[words],
            dtype=(dtype, dtype),
            is_pure=True,
            pack=1,
        )
    else:
        dtype = tl.bfloat16 if BF16 else tl.float16
        offset = 128.0 if BF16 else 1024.0
        lo = ((words >> SHIFT) & 0xF).to(tl.float32) + offset
        hi = ((words >> (SHIFT + 16)) & 0xF).to(tl.float32) + offset
        lo = lo.to(dtype)
        hi = hi.to(dtype)
    return lo, hi


@triton.jit
def _unpack_words(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
                  ASM: tl.constexpr):  # fmt: skip
    """``[BLOCK_N, BLOCK_K / 8]`` words (``NIBBLE_ROWS`` order) -> ``[BLOCK_N, BLOCK_K]``
    ``OFFSET + code``, each lop3's pair (rows k, k + 1) left side by side."""
    lo0, hi0 = _nibble_pair(words, 0, BF16, ASM)
    lo1, hi1 = _nibble_pair(words, 4, BF16, ASM)
    lo2, hi2 = _nibble_pair(words, 8, BF16, ASM)
    lo3, hi3 = _nibble_pair(words, 12, BF16, ASM)
    # each join appends an axis of 2: [..., x, y, z] is row 4x + 2y + z of the word, taken
    # from pair p = x + 2y (lo: z = 0, hi: z = 1)
    lo = tl.join(tl.join(lo0, lo1), tl.join(lo2, lo3))
    hi = tl.join(tl.join(hi0, hi1), tl.join(hi2, hi3))
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))


@triton.jit(do_not_specialize=["M"])
def _w4a16_tiles_kernel(
    x_ptr,
    w_desc,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    num_groups,
    stride_xm,
    stride_sg,
    stride_zg,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TG: tl.constexpr,
    HAS_ZP: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    OFFSET: tl.constexpr,
):
    # M tiles first: the programs sharing a tile of words run side by side
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    dtype = tl.bfloat16 if BF16 else tl.float16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K  # rows past K meet zero activations
        x = tl.load(
            x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + (k0 + offs_k)[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        h = _unpack_words(w_desc.load([pid_n * BLOCK_N, k0 // 8]), BLOCK_N, BLOCK_K, BF16, ASM)
        # the tile's groups: TG of them, GROUP_SIZE rows each (or one group, TG 1)
        if TG == 1:
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(dtype)
            if HAS_ZP:
                z = tl.load(z_ptr + g * stride_zg + offs_n, mask=n_mask, other=0)
                # integers below 2,048 (fp16) or 256 (bf16): exact
                w = (h - (z.to(tl.float32) + OFFSET).to(dtype)[:, None]) * s[:, None]
            else:
                w = (h - (OFFSET + 8.0)) * s[:, None]  # SYMMETRIC_ZERO
        else:
            g = k0 // GROUP_SIZE + tl.arange(0, TG)
            gm = n_mask[:, None] & (g < num_groups)[None, :]
            s = tl.load(s_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=gm, other=0.0)
            s = s.to(dtype)
            h3 = tl.reshape(h, (BLOCK_N, TG, BLOCK_K // TG))
            if HAS_ZP:
                z = tl.load(z_ptr + g[None, :] * stride_zg + offs_n[:, None], mask=gm, other=0)
                zo = (z.to(tl.float32) + OFFSET).to(dtype)
                w3 = (h3 - zo[:, :, None]) * s[:, :, None]
            else:
                w3 = (h3 - (OFFSET + 8.0)) * s[:, :, None]
            w = tl.reshape(w3, (BLOCK_N, BLOCK_K))
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# NIBBLE_ROWS[q]: the row (of a word's 8) whose code sits in bits 4q..4q+3. A lop3 at shift
# 4p yields the codes of bits 4p and 16 + 4p as one 16-bit pair: rows (r, r + 1) with
# r = 4 (p % 2) + 2 (p // 2), the neighbours the MMA takes from one register.
NIBBLE_ROWS = (0, 4, 2, 6, 1, 5, 3, 7)


def transpose_words(qweight: torch.Tensor) -> torch.Tensor:
    """``w4a16``'s ``[ceil(K/8), N]`` int32 codes (row ``8r + j`` in bits ``4j``) as
    ``[N, ceil(K/8)]`` (contiguous) with each word's codes in ``NIBBLE_ROWS`` order."""
    out = torch.zeros_like(qweight)
    for q, j in enumerate(NIBBLE_ROWS):
        out |= ((qweight >> (4 * j)) & 0xF) << (4 * q)
    return out.t().contiguous()


def tiles_fit(k: int, group_size: int, cfg: TileConfig) -> bool:
    """Whether these tiles hold a layer: ``K`` a multiple of 32 (16-byte rows of words for
    the TMA), and each tile's rows inside one group or in a power of two of whole ones."""
    bk = block_k(cfg)
    size = min(group_size, k)
    return k % 32 == 0 and (size % bk == 0 or (bk % size == 0 and is_power_of_2(bk // size)))


def w4a16_tiles(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W`` (module docstring), ``[M, N]`` in ``x``'s dtype. ``config``: the
    tiles (``block_k_bytes`` of packed codes a step); the words always come by the TMA."""
    m, k = x.shape
    n, rows = words.shape
    cfg = config or (INTERPRETER_CONFIG if is_interpreter() else DEFAULT_CONFIG)
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp16 or bf16, got {x.dtype}")
    if words.dtype != torch.int32 or rows != -(-k // PACK):
        raise ValueError(f"words must be [N, ceil(K/8) = {-(-k // PACK)}] int32, got "
                         f"{tuple(words.shape)} {words.dtype}")  # fmt: skip
    if not tiles_fit(k, group_size, cfg):
        raise ValueError(f"K={k} with groups of {group_size} does not fit tiles of "
                         f"{block_k(cfg)} rows: K must be a multiple of 32 and each tile "
                         f"inside one group or in a power of two of whole ones")  # fmt: skip
    size = min(group_size, k)
    groups = scales.shape[0]
    if scales.shape != (groups, n) or groups < -(-k // size):
        raise ValueError(f"scales must be [{-(-k // size)}, {n}], got {tuple(scales.shape)}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"zeros must match scales {tuple(scales.shape)}, got {tuple(zeros.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    words = words.contiguous()
    bk = block_k(cfg)
    from triton.tools.tensor_descriptor import TensorDescriptor

    w_desc = TensorDescriptor.from_tensor(words, [cfg.block_n, bk // PACK])
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _w4a16_tiles_kernel[grid](
        x,
        w_desc,
        scales,
        zeros if zeros is not None else scales,
        out,
        m,
        n,
        k,
        groups,
        x.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=bk,
        GROUP_SIZE=size,
        TG=max(1, bk // size),
        HAS_ZP=zeros is not None,
        BF16=x.dtype == torch.bfloat16,
        ASM=not is_interpreter(),
        OFFSET=128.0 if x.dtype == torch.bfloat16 else 1024.0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
