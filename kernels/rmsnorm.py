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

from kvscale.kernels._utils import is_power_of_2, next_power_of_2
from kvscale.kernels.fp8 import FP8_E4M3, quantize_groups_ref, quantize_store_groups


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
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # see load_norm_operands
    var = tl.sum(x * x, 0) / hidden
    normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_norm_operands(res_ptr, w_ptr, offs, mask):
    """The residual row and the weight (fp32) that :func:`add_rms_norm_row` takes, loaded
    by the caller as early as it can: a load issued after the norm's reduction (a barrier)
    waits a second memory round trip in a kernel of one program a row."""
    r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return r, w


@triton.jit
def add_rms_norm_row(x, r, w, res_ptr, out_ptr, offs, mask, hidden, eps):
    """One row: ``s = (x + r)`` rounded to the residual's dtype, stored at ``res_ptr``;
    ``w * rms_norm(s)`` stored at ``out_ptr``. ``x``, ``r`` (the residual row), ``w``
    (the weight): fp32, from :func:`load_norm_operands`."""
    s = (x + r).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + offs, s, mask=mask)
    s = s.to(tl.float32)
    var = tl.sum(s * s, 0) / hidden
    normed = (s * tl.rsqrt(var + eps)).to(res_ptr.dtype.element_ty).to(tl.float32)
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
    r, w = load_norm_operands(res_ptr + row * stride_r, w_ptr, offs, mask)
    add_rms_norm_row(
        x, r, w, res_ptr + row * stride_r, x_ptr + row * stride_x, offs, mask, hidden, eps
    )


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["num_rows"])
def _fused_add_rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, num_rows, hidden, eps, stride_x, stride_r, stride_q,
    stride_s, NUM_GROUPS: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    # the row as [NUM_GROUPS, GROUP]: the norm sums over both, the scales over the second
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, NUM_GROUPS)
    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (offs < hidden) & (row < num_rows)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r_ptrs = res_ptr + row * stride_r + offs
    r, w = load_norm_operands(res_ptr + row * stride_r, w_ptr, offs, mask)
    s = (x + r).to(res_ptr.dtype.element_ty)
    tl.store(r_ptrs, s, mask=mask)
    s = s.to(tl.float32)
    var = tl.sum(tl.sum(s * s, 1), 0) / hidden
    normed = (s * tl.rsqrt(var + eps)).to(res_ptr.dtype.element_ty).to(tl.float32)
    y = (normed * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    quantize_store_groups(
        y, q_ptr + row * stride_q + offs, s_ptr + row * stride_s + groups, mask,
        (groups * GROUP < hidden) & (row < num_rows),
    )  # fmt: skip


def fp8_group_fusable(hidden: int, group: int) -> bool:
    """Whether :func:`fused_add_rms_norm_quant` takes quantization groups of ``group``
    columns of a row of ``hidden``: one group a row, or power-of-two groups that tile it."""
    return group == hidden or (is_power_of_2(group) and hidden % group == 0)


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


def fused_add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual <- x + residual`` in place, and ``rms_norm(residual, weight, eps)`` in
    ``x``'s dtype quantized to FP8 per ``group`` columns of each row, returned as (codes
    ``[T, H]`` float8_e4m3fn, scales ``[T, H / group]`` fp32): those of
    :func:`fused_add_rms_norm` then ``fp8.quantize_groups`` (up to the order of the
    norm's sum: a code may be one step apart), in one kernel that never stores the
    16-bit norm (``x`` is left as it was). ``group``: see
    :func:`fp8_group_fusable`."""
    hidden = x.shape[-1]
    if residual.shape != x.shape or weight.shape != (hidden,):
        raise ValueError("x, residual must be [..., H] of one shape and weight [H]")
    if not fp8_group_fusable(hidden, group):
        raise ValueError(f"quantization groups of {group} do not tile rows of {hidden}")
    x2 = x.view(-1, hidden)
    r2 = residual.view(-1, hidden)
    if x2.stride(-1) != 1 or r2.stride(-1) != 1:
        raise ValueError("x and residual need a contiguous last dim")
    rows = x2.shape[0]
    q = torch.empty((rows, hidden), dtype=FP8_E4M3, device=x.device)
    scale = torch.empty((rows, hidden // group), dtype=torch.float32, device=x.device)
    if rows > 0:
        opts = row_launch_opts(hidden)
        width = opts["BLOCK"] if group == hidden else group
        _fused_add_rms_norm_quant_kernel[(rows,)](
            x2, r2, weight, q, scale, rows, hidden, eps, x2.stride(0), r2.stride(0),
            q.stride(0), scale.stride(0), NUM_GROUPS=opts["BLOCK"] // width, GROUP=width,
            num_warps=opts["num_warps"],
        )  # fmt: skip
    return q, scale


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


def fused_add_rms_norm_quant_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`fused_add_rms_norm_quant` (``residual`` in place, ``x`` kept)."""
    residual.copy_(x + residual)
    y = rms_norm_ref(residual, weight, eps).to(x.dtype)
    return quantize_groups_ref(y.reshape(-1, x.shape[-1]), group)
