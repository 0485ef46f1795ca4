"""SiLU-and-mul for gated MLPs, and FP8 quantization of its output."""

from __future__ import annotations

import torch
from torch import nn

from kvscale.kernels.activation import silu_quant_fusable
from kvscale.server.layers import ops
from kvscale.server.quantization.base import Fp8Activation


class SiluAndMul(nn.Module):
    """``x [T, 2*I]`` -> ``silu(x[:, :I]) * x[:, I:]`` of shape ``[T, I]``."""

    def forward(
        self, x: torch.Tensor, fp8_group: int | None = None
    ) -> torch.Tensor | Fp8Activation:
        """``fp8_group``: the next layer's ``fp8_input_group``; the output comes back
        quantized so (``Fp8Activation``) from the activation's own kernel where the
        groups suit it (``silu_quant_fusable``)."""
        inter = x.shape[-1] // 2
        if fp8_group is not None and silu_quant_fusable(inter, fp8_group):
            codes, scales = ops.silu_and_mul_quant(x.reshape(-1, 2 * inter), fp8_group)
            return Fp8Activation(codes.view(*x.shape[:-1], inter), scales, x.dtype)
        return ops.silu_and_mul(x)
