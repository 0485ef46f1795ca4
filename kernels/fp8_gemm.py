"""Block-scaled FP8 GEMM (W8A8, DeepSeek-V3 / Hugging Face ``fp8`` checkpoints).

Layouts:
    a:       ``[M, K]`` FP8 E4M3 activations, quantized per token and group of ``group_k``
             columns (``kvscale.kernels.fp8.quantize_groups``)
    a_scale: ``[M, K / group_k]`` fp32
    b:       ``[N, K]`` FP8 E4M3 weight (a linear layer's ``weight``)
    b_scale: ``[ceil(N / group_n), K / group_k]`` fp32, one per weight block
             (``weight_scale_inv``: ``w ~ b * b_scale``)
    out:     ``[M, N]`` in ``out_dtype``:
             ``sum_k a[m, k] a_scale[m, k/gk] b[n, k] b_scale[n/gn, k/gk]``

One program computes a ``BLOCK_M x BLOCK_N`` output tile; its K loop steps one scale group
(``BLOCK_K = group_k``) at a time, so each partial product is scaled by one activation
scale per row and one weight scale per column before it is accumulated (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import is_interpreter
from kvscale.kernels.fp8 import FP8_E4M3


def gemm_config(m: int) -> dict[str, int]:
    """Tile sizes: small M (decode) takes narrow row tiles; small tiles when interpreting."""
    if is_interpreter():
        return {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


# M changes every step: not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["M"])
def _w8a8_block_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    GROUP_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    a_scale_rows = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
    b_scale_cols = b_scale_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        k = g * BLOCK_K + offs_k
        k_mask = k < K
        a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        a_s = tl.load(a_scale_rows + g, mask=m_mask, other=0.0)
        b_s = tl.load(b_scale_cols + g, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
) -> None:
    (m, k), (n, kb) = a.shape, b.shape
    gn, gk = block
    if a.dtype != FP8_E4M3 or b.dtype != FP8_E4M3:
        raise ValueError(f"a and b must be {FP8_E4M3}, got {a.dtype}, {b.dtype}")
    if k != kb or k % gk:
        raise ValueError(f"a [{m}, {k}] and b [{n}, {kb}] need one K, a multiple of {gk}")
    if a_scale.shape != (m, k // gk):
        raise ValueError(f"a_scale must be [{m}, {k // gk}], got {tuple(a_scale.shape)}")
    if b_scale.shape != (-(-n // gn), k // gk):
        raise ValueError(f"b_scale must be [{-(-n // gn)}, {k // gk}], got {tuple(b_scale.shape)}")


def w8a8_block_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype`` (see the module docstring); ``block`` = (group_n,
    group_k) of the weight's scale grid."""
    _check(a, a_scale, b, b_scale, block)
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    a, b = a.contiguous(), b.contiguous()
    a_scale, b_scale = a_scale.float().contiguous(), b_scale.float().contiguous()
    cfg = gemm_config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _w8a8_block_kernel[grid](
        a,
        a_scale,
        b,
        b_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        b.stride(0),
        out.stride(0),
        a_scale.stride(0),
        b_scale.stride(0),
        GROUP_N=block[0],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block[1],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """FP8 ``w [N, K]`` times its block scales ``[ceil(N/gn), ceil(K/gk)]``, in fp32."""
    gn, gk = block
    s = scale.float().repeat_interleave(gn, 0).repeat_interleave(gk, 1)
    return w.float() * s[: w.shape[0], : w.shape[1]]


def w8a8_block_matmul_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Pure-torch reference (and the CPU path): both operands dequantized, fp32 matmul."""
    _check(a, a_scale, b, b_scale, block)
    x = a.float() * a_scale.float().repeat_interleave(block[1], 1)
    return (x @ dequantize_blocks(b, b_scale, block).T).to(out_dtype)
