"""The elementwise Triton kernels of ``ops`` as torch custom ops (``torch.ops.kvscale.*``).

Dynamo treats a custom op as one opaque call, so a model traced while ``ops`` routes to
these (``ops.traceable_kernels``) keeps each fused kernel as one node. Piecewise graphs
compiled with ``--piecewise-compiler eager`` run the traced pieces as they are: traced
through the references instead, each RMS norm and SiLU-and-mul ran as several unfused aten
kernels (B 8.6% below Inductor's pieces on an H200; bench/NOTES.md "e68 and e71
measured" has the figures and this reading of them). Inductor keeps tracing the
references, which it fuses itself.

An op's fake (the shapes and dtypes Dynamo traces with) is its reference run on copies of
the fake inputs; the kernels and their references share signatures and layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvscale.kernels import activation, fp8, rmsnorm


def _opaque(
    name: str, kernel: Callable[..., Any], ref: Callable[..., Any], mutates: tuple[str, ...] = ()
) -> Any:
    """``kernel`` registered as ``kvscale::name`` (mutating ``mutates``), faked by ``ref``."""
    op = torch.library.custom_op(f"kvscale::{name}", kernel, mutates_args=mutates)

    def fake(*args: Any) -> Any:
        return ref(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args))

    op.register_fake(fake)
    return op


rms_norm = _opaque("rms_norm", rmsnorm.rms_norm, rmsnorm.rms_norm_ref)
fused_add_rms_norm = _opaque(
    "fused_add_rms_norm",
    rmsnorm.fused_add_rms_norm,
    rmsnorm.fused_add_rms_norm_ref,
    ("x", "residual"),
)
fused_add_rms_norm_quant = _opaque(
    "fused_add_rms_norm_quant",
    rmsnorm.fused_add_rms_norm_quant,
    rmsnorm.fused_add_rms_norm_quant_ref,
    ("residual",),
)
silu_and_mul = _opaque("silu_and_mul", activation.silu_and_mul, activation.silu_and_mul_ref)
silu_and_mul_quant = _opaque(
    "silu_and_mul_quant", activation.silu_and_mul_quant, activation.silu_and_mul_quant_ref
)
fp8_quantize_groups = _opaque("fp8_quantize_groups", fp8.quantize_groups, fp8.quantize_groups_ref)

# the names of ``ops`` these stand for
OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "fused_add_rms_norm_quant": fused_add_rms_norm_quant,
    "silu_and_mul": silu_and_mul,
    "silu_and_mul_quant": silu_and_mul_quant,
    "fp8_quantize_groups": fp8_quantize_groups,
}
