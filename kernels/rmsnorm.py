"""RMSNorm and fused residual-add + RMSNorm, with Hugging Face Llama numerics.

Layouts: ``x, residual [T, H]`` (or ``[..., H]``; last dim contiguous), ``weight [H]``;
fp16 / bf16 / fp32. Computed as ``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``:
statistics in fp32, the normalized value rounded to the input dtype before the weight
multiply. The fused residual add is rounded to the residual dtype (as ``residual + x`` in HF).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import next_power_of_2


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = (offs < hidden) & (row < num_rows)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 0) / hidden
    normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_row(x, res_ptr, w_ptr, out_ptr, offs, mask, hidden, eps):
    """One row: ``s = (x + residual)`` rounded to the residual's dtype, stored at
    ``res_ptr``; ``weight * rms_norm(s)`` stored at ``out_ptr``. ``x``: the row in fp32."""
    r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + offs, s, mask=mask)
    s = s.to(tl.float32)
    var = tl.sum(s * s, 0) / hidden
    normed = (s * tl.rsqrt(var + eps)).to(res_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_rows"])
def _fused_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = (offs < hidden) & (row < num_rows)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    add_rms_norm_row(
        x, res_ptr + row * stride_r, w_ptr, x_ptr + row * stride_x, offs, mask, hidden, eps
    )


def row_launch_opts(hidden: int) -> dict[str, int]:
    """BLOCK (the row padded to a power of two) and warps of a kernel with one program a row."""
    block = next_power_of_2(hidden)
    return {"BLOCK": block, "num_warps": max(1, min(16, block // 512))}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[..., H]`` -> ``weight * rms_normalized(x)``; dtype = promote(x.dtype, weight.dtype)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            weight,
            out,
            x2.shape[0],
            hidden,
            eps,
            x2.stride(0),
            out.stride(0),
            **row_launch_opts(hidden),
        )
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual <- x + residual``; ``x <- rms_norm(residual, weight, eps)``."""
    hidden = x.shape[-1]
    if residual.shape != x.shape or weight.shape != (hidden,):
        raise ValueError("x, residual must be [..., H] of one shape and weight [H]")
    x2 = x.view(-1, hidden)
    r2 = residual.view(-1, hidden)
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        raise ValueError("x and residual need a contiguous last dim")
    if x2.shape[0] > 0:
        _fused_add_rms_norm_kernel[(x2.shape[0],)](
            x2,
            r2,
            weight,
            x2.shape[0],
            hidden,
            eps,
            x2.stride(0),
            r2.stride(0),
            **row_launch_opts(hidden),
        )


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face ``LlamaRMSNorm`` numerics."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """Reference of :func:`fused_add_rms_norm` (in place)."""
    residual.copy_(x + residual)
    x.copy_(rms_norm_ref(residual, weight, eps))
