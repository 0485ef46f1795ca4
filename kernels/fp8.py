"""FP8 (E4M3) helpers shared by the kernels: the dtype, its range, and round-to-nearest in
fp32 arithmetic.

``round_to_e4m3`` rounds an fp32 value (already clamped to +-448) to the nearest E4M3 value,
ties to even, as fp32; the final ``.to(float8)`` is then exact. The kernels quantize with it
instead of relying on the conversion instruction alone because Triton's CPU interpreter
rounds fp32 -> fp8 wrongly (31.8 became 16): with it, the interpreter, the GPU and torch's
``Tensor.to(torch.float8_e4m3fn)`` give the same bits, including the sign of a negative
value rounded to zero (-0, 0x80) and NaN kept NaN, as ``quantize_fp8_ref`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import next_power_of_2

FP8_E4M3 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_E4M3).max)  # 448
FP8_DTYPES = (torch.float8_e4m3fn,)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` clamped to +-448 and rounded to E4M3 (``scale``: fp32, broadcastable)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3)


@triton.jit
def round_to_e4m3(x):
    """``x`` (fp32, |x| <= 448) rounded to the nearest E4M3 value (ties to even), as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    # The E4M3 step at x's binade is 2**(e - 3); below 2**-6 the subnormal step 2**-9.
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(x) * inv_step  # exact: a power of two, |y| < 16
    r = ((y + 12582912.0) - 12582912.0) * step  # + 1.5 * 2**23: rounds half to even
    # x's sign bit set on r, not -r: Triton 3.6 compiles -r as 0.0 - r (fixed later by
    # triton-lang/triton#10270), which is +0.0 for r = +0.0, so a small negative x that
    # rounds to zero lost its sign (stored 0x00 where torch stores -0, 0x80).
    return (r.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_e4m3(x, scale):
    """``x / scale`` (IEEE division) clamped to +-448 and rounded to E4M3, as fp32: the
    kernels' version of :func:`quantize_fp8_ref`. NaN stays NaN, as torch's clamp keeps
    it (the default clamp leaves NaN unspecified: on the GPU min/max make it -448)."""
    y = tl.clamp(
        tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL
    )
    return round_to_e4m3(y)


@triton.jit
def quantize_store_groups(y, q_ptrs, s_ptrs, mask, s_mask):
    """Dynamic FP8 quantization of the rows of ``y [NG, G]`` (fp32, values already rounded
    to the activation's dtype, masked ones 0), one group a row: its scale ``absmax / 448``
    (at least 1e-12) stored at ``s_ptrs [NG]`` and its codes at ``q_ptrs [NG, G]``; the
    bits of :func:`quantize_groups_ref`. Kernels that make an activation call it on the
    values in registers, so the activation is never stored in 16 bits and read back."""
    amax = tl.max(tl.abs(y), 1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    tl.store(s_ptrs, scale, mask=s_mask)
    tl.store(q_ptrs, quantize_e4m3(y, scale[:, None]).to(q_ptrs.dtype.element_ty), mask=mask)


_MIN_SCALE = 1e-12  # an all-zero group still gets a finite scale


def quantize_groups_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``[M, K]`` FP8, ``[M, K / group]`` fp32 scales): each group of
    ``group`` consecutive columns of a row scaled by its absmax / 448 (``group = K``:
    one scale per row, per-token quantization)."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"K={k} is not a multiple of the quantization group {group}")
    g = x.float().reshape(m, k // group, group)
    # IEEE division (as compressed-tensors computes it): torch on CUDA divides by a
    # Python scalar as a multiplication by its reciprocal, so divide by a device tensor
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE)
    scale = amax / torch.full((), FP8_MAX, device=x.device)
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_E4M3)
    return q.reshape(m, k), scale.reshape(m, k // group)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, group, stride_x, stride_q, stride_s, BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    x_row = x_ptr + row * stride_x + g * group
    q_row = q_ptr + row * stride_q + g * group
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole group in registers: one load, then its absmax and codes
        offs2 = offs[None, :]
        mask = offs2 < group
        x = tl.load(x_row + offs2, mask=mask, other=0.0).to(tl.float32)
        s_offs = tl.arange(0, 1)
        quantize_store_groups(
            x, q_row + offs2, s_ptr + row * stride_s + g + s_offs, mask, s_offs < 1
        )
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, group, BLOCK):
            mask = k + offs < group
            x = tl.load(x_row + k + offs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 448.0)
        tl.store(s_ptr + row * stride_s + g, scale)
        for k in range(0, group, BLOCK):  # the group again, from L2
            mask = k + offs < group
            x = tl.load(x_row + k + offs, mask=mask, other=0.0)
            tl.store(
                q_row + k + offs, quantize_e4m3(x, scale).to(q_ptr.dtype.element_ty), mask=mask
            )


ONE_PASS_MAX = 16384  # a group this long or shorter is quantized from registers


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_groups_ref` in one kernel (the same bits): a program per row and
    group, which holds a group of up to ``ONE_PASS_MAX`` values in registers (one read
    of it; longer groups are read twice, the second time from L2). One pass replaced
    two after lease r23 timed 6 us a launch at 248 rows of 4,096 (NOTES e38)."""
    m, k = x.shape
    if k % group:
        raise ValueError(f"K={k} is not a multiple of the quantization group {group}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8_E4M3, device=x.device)
    scale = torch.empty((m, k // group), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    one_pass = group <= ONE_PASS_MAX
    block = next_power_of_2(group) if one_pass else 1024
    warps = 1 if block < 512 else (4 if block <= 4096 else 8)
    _quantize_groups_kernel[(m, k // group)](
        x, q, scale, group, x.stride(0), q.stride(0), scale.stride(0), BLOCK=block,
        ONE_PASS=one_pass, num_warps=warps,
    )  # fmt: skip
    return q, scale
