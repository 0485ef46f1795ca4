"""A tiled GEMM on the tensor cores, ``y = x @ w.T``, for the rows a decode step runs.

Layouts:
    x:       ``[M, K]`` bf16 / fp16 / fp32, or FP8 E4M3 with ``x_scale``
    w:       ``[N, K]`` (a linear layer's ``weight``), ``x``'s dtype
    x_scale: ``[M]`` fp32, one per row (FP8 only; per-token dynamic or a static scalar
             expanded)
    w_scale: ``[N]`` fp32, one per output channel (FP8 only)
    out:     ``[M, N]`` in ``out_dtype``: ``x_scale[m] w_scale[n] sum_k x[m, k] w[n, k]``

One program computes a ``BLOCK_M x BLOCK_N`` tile, stepping K by ``BLOCK_K`` with its
loads ``num_stages`` deep; the scales multiply the fp32 accumulator once, after the loop
(row-wise scales factor out of the sum). Programs are ordered M-tile first, so the few
programs that share one tile of ``w`` (M <= a few hundred rows) run together and the
weight is read from HBM once. On Hopper ``tl.dot`` becomes ``wgmma``; FP8 operands need
K-major tiles on both sides, which is what loading ``w`` as ``[BLOCK_N, BLOCK_K]`` and
transposing the view gives.

Where it runs: FP8 products of at most 16 rows (``server/quantization/fp8.py``) and the LM
head up to 64 rows (``server/layers/embedding.py``), on 16- and 64-row tiles: on an H100
those took 0.81-0.86x and 0.91-0.95x cuBLAS's time, while from 128 rows up cuBLAS was
1.15-1.31x faster on every bf16 layer of an 8B model (``bench/tile_mm_bench.py``; NOTES
e94-e97).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import dot_precision, is_interpreter
from kvscale.kernels.fp8 import FP8_E4M3


@dataclass(frozen=True)
class TileConfig:
    """One launch's tiles: ``block_k_bytes`` is BLOCK_K in bytes (128: 64 bf16 values or
    128 FP8 ones a step, the same bytes per stage either way)."""

    block_m: int
    block_n: int
    block_k_bytes: int = 128
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False  # tiles fetched by the TMA (Hopper on), not by each thread's loads

    def block_k(self, dtype: torch.dtype) -> int:
        return self.block_k_bytes // dtype.itemsize

    def smem_bytes(self) -> int:
        """Shared memory the pipelined loads take (both operands, every stage)."""
        return (self.block_m + self.block_n) * self.block_k_bytes * self.num_stages

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k_bytes}B"
                f"w{self.num_warps}s{self.num_stages}{'tma' if self.tma else ''}")  # fmt: skip


INTERPRETER_CONFIG = TileConfig(16, 32, block_k_bytes=64, num_warps=4, num_stages=1)
DEFAULT_CONFIG = TileConfig(128, 128, num_warps=8, num_stages=4)


@triton.jit
def _tile_of_program(M, BLOCK_M: tl.constexpr):
    # M tiles first: the programs that share one tile of w run side by side
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    return pid % num_m, pid // num_m


@triton.jit
def _scale_and_store(
    acc, out_ptr, x_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_om, SCALED: tl.constexpr
):
    m_mask = offs_m < M
    n_mask = offs_n < N
    if SCALED:
        x_s = tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)
        w_s = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
        acc = acc * x_s[:, None] * w_s[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _tile_mm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    x_scale_ptr,
    w_scale_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    SCALED: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile_of_program(M, BLOCK_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_tile = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_tile = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_tile, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_tile, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < K - k0
            x = tl.load(x_tile, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_tile, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    _scale_and_store(
        acc, out_ptr, x_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_om, SCALED
    )


@triton.jit(do_not_specialize=["M"])
def _tile_mm_tma_kernel(
    x_desc,
    w_desc,
    out_ptr,
    x_scale_ptr,
    w_scale_ptr,
    M,
    N,
    K,
    stride_om,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # as _tile_mm_kernel, its tiles fetched by the TMA (out-of-range rows and columns
    # read as zeros)
    pid_m, pid_n = _tile_of_program(M, BLOCK_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([off_m, k0])
        w = w_desc.load([off_n, k0])
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    _scale_and_store(
        acc, out_ptr, x_scale_ptr, w_scale_ptr, offs_m, offs_n, M, N, stride_om, SCALED
    )


def _check(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor | None,
    w_scale: torch.Tensor | None,
) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x [M, K] and w [N, K] need one K, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")  # fmt: skip
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    fp8 = x.dtype == FP8_E4M3
    if fp8 != (x_scale is not None) or fp8 != (w_scale is not None):
        raise ValueError(f"scales are given with FP8 ({FP8_E4M3}) operands and only then; "
                         f"got {x.dtype} with x_scale {x_scale is not None}, "
                         f"w_scale {w_scale is not None}")  # fmt: skip
    if fp8:
        assert x_scale is not None and w_scale is not None
        if x_scale.numel() != x.shape[0] or w_scale.numel() != w.shape[0]:
            raise ValueError(f"x_scale must hold {x.shape[0]} values and w_scale "
                             f"{w.shape[0]}, got {x_scale.numel()} and "
                             f"{w_scale.numel()}")  # fmt: skip
    elif x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x's dtype must be bf16, fp16, fp32 or {FP8_E4M3}, got {x.dtype}")


def tma_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The TMA's rule for both operands: 16-byte aligned bases and row strides."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, w)
    )


def tile_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: TileConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[M, N]`` (see the module docstring), written into ``out`` where given (``[M,
    N]``, unit column stride: a CUDA graph's static buffer); ``out_dtype`` defaults to
    ``out``'s or ``x``'s (FP8 operands need one); ``config`` to ``DEFAULT_CONFIG``
    (``INTERPRETER_CONFIG``'s small tiles when interpreting)."""
    _check(x, w, x_scale, w_scale)
    if out_dtype is None and out is not None:
        out_dtype = out.dtype
    if out_dtype is None:
        if x.dtype == FP8_E4M3:
            raise ValueError("FP8 operands need an out_dtype (bf16 or fp16)")
        out_dtype = x.dtype
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != out_dtype or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] {out_dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")  # fmt: skip
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    scaled = x_scale is not None
    if scaled:
        assert x_scale is not None and w_scale is not None
        x_scale = x_scale.reshape(-1).float().contiguous()
        w_scale = w_scale.reshape(-1).float().contiguous()
    cfg = config or (INTERPRETER_CONFIG if is_interpreter() else DEFAULT_CONFIG)
    block_k = cfg.block_k(x.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    common = dict(SCALED=scaled, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                  DOT_PRECISION=dot_precision(x.dtype), num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)  # fmt: skip
    x_s = x_scale if scaled else x
    w_s = w_scale if scaled else x
    if cfg.tma and tma_fits(x, w):
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, block_k])
        w_desc = TensorDescriptor.from_tensor(w, [cfg.block_n, block_k])
        _tile_mm_tma_kernel[grid](x_desc, w_desc, out, x_s, w_s, m, n, k, out.stride(0), **common)
    else:
        _tile_mm_kernel[grid](x, w, out, x_s, w_s, m, n, k, x.stride(0), w.stride(0),
                              out.stride(0), EVEN_K=k % block_k == 0, **common)  # fmt: skip
    return out


def tile_mm_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """The fp32 product of the dequantized operands, in ``out_dtype`` (the reference)."""
    _check(x, w, x_scale, w_scale)
    y = x.float() @ w.float().t()
    if x_scale is not None and w_scale is not None:
        y = y * x_scale.reshape(-1, 1).float() * w_scale.reshape(1, -1).float()
    return y.to(out_dtype or x.dtype)
