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
