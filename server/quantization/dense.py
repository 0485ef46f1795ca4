"""Dense weights: ``weight [out, in]`` in the model dtype, multiplied by ``F.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscale.server.quantization.base import LinearMethod, set_weight_attrs


class DenseLinearMethod(LinearMethod):
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        layer.register_parameter("weight", set_weight_attrs(weight, output_dim=0, input_dim=1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
