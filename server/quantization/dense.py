"""Dense weights: ``weight [out, in]`` in the model dtype, multiplied by ``F.linear``, or
as split-K partial products (:func:`split_k_products`) for a consumer that sums them."""

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

    def apply_split_k(self, layer: nn.Module, x: torch.Tensor, parts: int) -> torch.Tensor | None:
        if x.shape[-1] % parts:
            return None
        return split_k_products(x, layer.weight, parts)


def split_k_products(x: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    """``x [T, K] @ w[N, K].T`` as the ``[parts, T, N]`` fp32 products of ``parts`` equal
    slices of K: one batched GEMM over strided views of ``w`` (nothing copied), whose
    sum the next kernel takes. At a few rows cuBLAS runs it without the split-K
    reduction kernel it adds to ``F.linear`` for o_proj's and down_proj's shapes (8B
    layers on an H100: 18.5 -> 15.8 and 49.4 -> 46.8 us, ``bench/gemm_rows.py``)."""
    t, k = x.shape
    n = w.shape[0]
    xs = x.reshape(t, parts, k // parts).transpose(0, 1)
    ws = w.view(n, parts, k // parts).permute(1, 2, 0)
    if x.dtype == torch.float32:
        return torch.bmm(xs, ws)
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())  # (no out_dtype on the CPU)
