"""Elementwise operators used by the model layers.

By default they are the pure-PyTorch references that sit beside each Triton kernel in
``kvscale.kernels`` (the CPU path); on CUDA the model runner routes the same names to
the kernels themselves with ``use_kernels(True)``. Signatures and layouts are the
kernels' (see each kernel module's docstring).

The routing is process-wide, and one process may hold several engines (a CPU one and a
CUDA one, an eager one and a compiled one): each worker runs its model inside
``kernels(its own setting)``, never on what the engine built last left behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvscale.kernels import activation, fp8, rmsnorm, rotary, top_p, w4a16
from kvscale.kernels import argmax as argmax_kernel

rms_norm = rmsnorm.rms_norm_ref
fused_add_rms_norm = rmsnorm.fused_add_rms_norm_ref
fused_add_rms_norm_quant = rmsnorm.fused_add_rms_norm_quant_ref
silu_and_mul = activation.silu_and_mul_ref
silu_and_mul_quant = activation.silu_and_mul_quant_ref
rotary_embedding = rotary.rotary_embedding_ref
w4a16_gemm = w4a16.w4a16_gemm_ref
fp8_quantize_groups = fp8.quantize_groups_ref
# greedy tokens over the last dim of [N, V], for the sampler of pipelined steps, where the
# GPU's time counts; the draft and verify steps, where the host waits on each launch,
# keep torch's one launch (the kernel takes two, each with more host time)
argmax = argmax_kernel.argmax_ref
# each row's nucleus threshold: a radix select on the device instead of a sort of the row
top_p_threshold = top_p.top_p_threshold_ref
_kernels = False


def use_kernels(enabled: bool) -> bool:
    """Routes the operators above to the Triton kernels (True) or the references (False);
    returns the previous routing."""
    global _kernels
    previous, _kernels = _kernels, enabled
    suffix = "" if enabled else "_ref"
    globals().update(
        rms_norm=getattr(rmsnorm, "rms_norm" + suffix),
        fused_add_rms_norm=getattr(rmsnorm, "fused_add_rms_norm" + suffix),
        fused_add_rms_norm_quant=getattr(rmsnorm, "fused_add_rms_norm_quant" + suffix),
        silu_and_mul=getattr(activation, "silu_and_mul" + suffix),
        silu_and_mul_quant=getattr(activation, "silu_and_mul_quant" + suffix),
        rotary_embedding=getattr(rotary, "rotary_embedding" + suffix),
        w4a16_gemm=getattr(w4a16, "w4a16_gemm" + suffix),
        fp8_quantize_groups=getattr(fp8, "quantize_groups" + suffix),
        argmax=getattr(argmax_kernel, "argmax" + suffix),
        top_p_threshold=getattr(top_p, "top_p_threshold" + suffix),
    )
    return previous


def routed_to_kernels() -> bool:
    """Whether the operators above are the kernels now (else the references)."""
    return _kernels


def few_rows_on_kernels(x: torch.Tensor, max_rows: int) -> bool:
    """Whether ``x [T, ...]`` is where the GEMM kernels for few rows run
    (``kvscale.kernels.tile_mm``): on CUDA, 1 to ``max_rows`` rows, the operators routed
    to the kernels, and outside a Dynamo trace (traced and compiled graphs keep torch's
    GEMMs)."""
    return (
        x.is_cuda and 0 < x.shape[0] <= max_rows and _kernels and not torch.compiler.is_compiling()
    )


@contextlib.contextmanager
def kernels(enabled: bool) -> Iterator[None]:
    """``use_kernels(enabled)`` inside the block; the previous routing after it."""
    previous = use_kernels(enabled)
    try:
        yield
    finally:
        use_kernels(previous)


@contextlib.contextmanager
def traceable_kernels() -> Iterator[None]:
    """The kernels inside the block, the fusable ones as custom ops that Dynamo keeps as
    one opaque call each (``kernel_ops``); the previous routing after it."""
    from kvscale.server.layers import kernel_ops  # registers the ops on first use

    previous = use_kernels(True)
    try:
        globals().update(kernel_ops.OPS)
        yield
    finally:
        use_kernels(previous)


def routing_for_tracing(compiler: str, kernels_on: bool) -> contextlib.AbstractContextManager[None]:
    """What a piecewise trace sees: the references for Inductor, which fuses them itself;
    for the ``eager`` compiler, whose pieces run as traced, the kernels as opaque ops when
    the model runs on them (``kernels_on``), else the references it runs on."""
    if compiler == "eager" and kernels_on:
        return traceable_kernels()
    return kernels(False)
