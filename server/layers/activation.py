"""SiLU-and-mul for gated MLPs."""

from __future__ import annotations

import torch
from torch import nn

from kvscale.server.layers import ops


class SiluAndMul(nn.Module):
    """``x [T, 2*I]`` -> ``silu(x[:, :I]) * x[:, I:]`` of shape ``[T, I]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
