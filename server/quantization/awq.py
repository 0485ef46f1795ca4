"""AutoAWQ checkpoints (``quant_method: awq``), GEMM layout.

``qweight [K, N/8]`` and ``qzeros [K/g, N/8]`` int32, packed along the outputs in AWQ's
interleaved nibble order; ``scales [K/g, N]`` (``int4_formats`` describes the layout).
Config keys as AutoAWQ and transformers write them: ``bits``/``w_bit`` (only 4),
``group_size``/``q_group_size`` (-1: one group per output channel), ``zero_point``,
``version``/``format`` (only ``gemm``: the GEMV, Marlin and ExLlama layouts are packed
differently and refused), ``modules_to_not_convert`` (substrings of module names left
dense; each must name a module of the model). The zero points are always read from
``qzeros``, as AutoAWQ's GEMM kernels do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvscale.kernels.w4a16 import pack_int4_rows
from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.quantization.base import LinearMethod, QuantizationConfig
from kvscale.server.quantization.dense import DenseLinearMethod
from kvscale.server.quantization.int4 import Int4LinearMethod, int4_param
from kvscale.server.quantization.int4_formats import unpack_awq
from kvscale.server.quantization.layer_names import check_names_exist, is_skipped

PACK = 8


def _first(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    return next((raw[k] for k in keys if raw.get(k) is not None), default)


class AwqConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, raw: dict[str, Any], model: ModelConfig) -> None:
        bits = _first(raw, "bits", "w_bit", default=4)
        if bits != 4:
            raise CheckpointError(f"awq checkpoint: {bits}-bit weights are not supported (only 4)")
        version = str(_first(raw, "version", "format", default="gemm")).lower()
        if version != "gemm":
            raise CheckpointError(
                f"awq checkpoint: version {version!r} packs its weights for one kernel "
                "family (GEMV, Marlin, ExLlama, IPEX); kvscale loads the GEMM layout only "
                "(version 'gemm', AutoAWQ's default)"
            )
        group = int(_first(raw, "group_size", "q_group_size", default=128))
        if group != -1 and group < 1:
            raise CheckpointError(f"awq checkpoint: group_size must be -1 or > 0, got {group}")
        self.group_size = None if group == -1 else group
        self.skip = list(raw.get("modules_to_not_convert") or [])
        check_names_exist(self.skip, model, "modules_to_not_convert")

    def linear_method(self, prefix: str) -> LinearMethod:
        if is_skipped(prefix, lambda n: any(s in n for s in self.skip), "modules_to_not_convert"):
            return DenseLinearMethod()
        return AwqLinearMethod(self.group_size)

    def describe(self) -> str:
        g = f"groups of {self.group_size}" if self.group_size else "per-channel"
        return f"awq 4-bit weights (GEMM layout, {g}, zero points), 16-bit activations"


class AwqLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int | None) -> None:
        super().__init__(group_size, act_order=False, what="awq checkpoint")

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        for shard in layer.output_partition_sizes:
            self.check_divisible(shard, "each output shard")
        groups, split = self.groups(layer, in_features)
        g_dim = 0 if split else None
        packed = dict(output_dim=1, packed_dim=1, pack_factor=PACK)
        layer.register_parameter(
            "qweight", int4_param(in_features, out_features // PACK, input_dim=0, **packed)
        )
        layer.register_parameter(
            "qzeros", int4_param(groups, out_features // PACK, input_dim=g_dim, **packed)
        )
        layer.register_parameter(
            "scales",
            int4_param(groups, out_features, dtype=torch.float32, input_dim=g_dim, output_dim=1),
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        k, n = layer.qweight.shape[0], layer.scales.shape[1]
        qweight = pack_int4_rows(unpack_awq(layer.qweight.data, n))  # along K, in order
        zeros = unpack_awq(layer.qzeros.data, n)
        drop = ("qweight", "qzeros", "scales")
        self.finish(layer, qweight, k, layer.scales.data, zeros, None, drop)
