"""Elementwise operators used by the model layers, in plain PyTorch.

This is the CPU path and the reference; on CUDA the model runner switches these
names to the Triton kernels of ``kvscale.kernels`` (same signatures) via ``use_kernels``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, H]`` -> ``weight * (x / rms(x))``; computed in fp32, cast like HF Llama."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual <- x + residual``; ``x <- rms_norm(residual)``. ``[T, H]``."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [T, 2*I]`` -> ``silu(x[:, :I]) * x[:, I:]``, ``[T, I]``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotates ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place (NeoX / HF-Llama halves).

    ``cos_sin_cache [max_pos, D]`` fp32 holds cos in its first D/2 columns, sin in the rest.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        x.copy_(torch.cat((o1, o2), dim=-1))


_TORCH_OPS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_embedding": rotary_embedding,
}


def use_kernels(enabled: bool) -> None:
    """Routes the operators above to the Triton kernels (True) or to PyTorch (False)."""
    g = globals()
    if not enabled:
        g.update(_TORCH_OPS)
        return
    from kvscale.kernels import activation, rmsnorm, rotary

    g.update(
        rms_norm=rmsnorm.rms_norm,
        fused_add_rms_norm=rmsnorm.fused_add_rms_norm,
        silu_and_mul=activation.silu_and_mul,
        rotary_embedding=rotary.rotary_embedding,
    )
