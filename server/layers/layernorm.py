"""RMSNorm with an optional fused residual add, and FP8 quantization of its output."""

from __future__ import annotations

import torch
from torch import nn

from kvscale.kernels.rmsnorm import fp8_group_fusable
from kvscale.server.layers import ops
from kvscale.server.parallel import ParallelState
from kvscale.server.quantization.base import Fp8Activation


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        partial: ParallelState | None = None,
        fp8_group: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        """``x [T, H]``. With ``residual``: returns (norm(x + residual), x + residual).

        ``partial``: x is this rank's share of a sum over ``partial``'s ranks (a
        row-parallel layer's output), summed here first; with ``residual``, in one fused
        all-reduce + add + RMSNorm where the ranks can (``ParallelState``).
        ``fp8_group``: the next layer's ``fp8_input_group``; with ``residual`` and no
        ``partial``, the norm comes back quantized so (``Fp8Activation``) from the
        norm's own kernel, where the groups tile the row."""
        if residual is None:
            if partial is not None:
                x = partial.all_reduce(x)
            return ops.rms_norm(x, self.weight, self.eps)
        if partial is None and fp8_group is not None and fp8_group_fusable(x.shape[-1], fp8_group):
            codes, scales = ops.fused_add_rms_norm_quant(
                x, residual, self.weight, self.eps, fp8_group
            )
            return Fp8Activation(codes, scales, x.dtype), residual
        if partial is not None:
            partial.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
        else:
            ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual
