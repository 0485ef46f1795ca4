"""SiLU-and-mul (the gated MLP activation of Llama).

Layout: ``x [T, 2*I]`` (or ``[..., 2*I]``; last dim contiguous), fp16 / bf16 / fp32 ->
``out [T, I]`` in x's dtype, ``out = silu(x[:, :I]) * x[:, I:]`` computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvscale.kernels._utils import next_power_of_2
from kvscale.kernels.fp8 import FP8_E4M3, ONE_PASS_MAX, quantize_groups_ref, quantize_store_groups
from kvscale.kernels.rmsnorm import row_launch_opts


@triton.jit
def _silu_mul(a, b):
    """``silu(a) * b`` in fp32 (``a``, ``b``: fp32)."""
    return a / (1.0 + tl.exp(-a)) * b


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    num_rows,
    inter,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < inter) & (row < num_rows)
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = _silu_mul(a, b)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2*I]`` -> ``[..., I]``: ``silu(first half) * second half``."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(1024, next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2,
            out,
            x2.shape[0],
            inter,
            x2.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=4,
        )
    return out.view(*x.shape[:-1], inter)


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, num_rows, inter, group, stride_x, stride_q, stride_s,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * group + tl.arange(0, BLOCK)[None, :]
    mask = (offs < (g + 1) * group) & (row < num_rows)
    a = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = _silu_mul(a, b).to(x_ptr.dtype.element_ty).to(tl.float32)
    s_offs = tl.arange(0, 1)
    quantize_store_groups(
        y, q_ptr + row * stride_q + offs, s_ptr + row * stride_s + g + s_offs, mask,
        (s_offs < 1) & (row < num_rows),
    )  # fmt: skip


def silu_quant_fusable(inter: int, group: int) -> bool:
    """Whether :func:`silu_and_mul_quant` takes quantization groups of ``group`` columns
    of an output row of ``inter``: groups of at most ``ONE_PASS_MAX`` that tile it."""
    return group <= ONE_PASS_MAX and inter % group == 0


def silu_and_mul_quant(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, 2*I]`` -> ``silu_and_mul(x)`` quantized to FP8 per ``group`` columns
    (at most ``ONE_PASS_MAX``; ``I`` a multiple of it) as (codes ``[T, I]``
    float8_e4m3fn, scales ``[T, I / group]`` fp32): the bits of ``silu_and_mul`` then
    ``fp8.quantize_groups``, one program a row and group that never stores the 16-bit
    activation."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, 2*I], got {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    if not silu_quant_fusable(inter, group):
        raise ValueError(f"quantization groups of {group} do not tile rows of {inter}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    q = torch.empty((rows, inter), dtype=FP8_E4M3, device=x.device)
    scale = torch.empty((rows, inter // group), dtype=torch.float32, device=x.device)
    if rows > 0:
        _silu_and_mul_quant_kernel[(rows, inter // group)](
            x, q, scale, rows, inter, group, x.stride(0), q.stride(0), scale.stride(0),
            **row_launch_opts(group),
        )  # fmt: skip
    return q, scale


def silu_and_mul_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`silu_and_mul_quant`."""
    return quantize_groups_ref(silu_and_mul_ref(x), group)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference (fp32 math, cast back)."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)
