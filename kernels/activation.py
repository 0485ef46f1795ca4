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
    y = a / (1.0 + tl.exp(-a)) * b
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


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch reference (fp32 math, cast back)."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)
