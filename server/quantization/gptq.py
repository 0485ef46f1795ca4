"""GPTQ checkpoints (``quant_method: gptq``: AutoGPTQ, GPTQModel, optimum).

``qweight [K/8, N]`` packed along the inputs, ``qzeros [K/g, N/8]`` packed along the
outputs, ``scales [K/g, N]``, ``g_idx [K]`` (``int4_formats`` describes the layout).
Config keys: ``bits`` (only 4), ``group_size`` (-1: per channel), ``desc_act``
(act-order: ``g_idx`` maps each input row to its group, in any order), ``sym``,
``checkpoint_format`` or ``format`` (``gptq``: v1, zero points stored minus one;
``gptq_v2``: stored as they are; the Marlin, BitBLAS, QQQ and other kernel-specific
layouts are refused), ``modules_to_not_convert``, ``lm_head`` (a quantized LM head is
refused), ``dynamic`` (per-module overrides: refused).

kvscale runs q/k/v (and gate/up) as one layer with one ``g_idx``, as vLLM does: GPTQ
orders a layer's inputs by the Hessian of its input, which the parts of a fused layer
share, so their ``g_idx`` are the same.

Symmetric checkpoints are dequantized with zero point 8 whatever ``qzeros`` says, after
checking that it says 8 (v2) or 7 (v1): some writers store v2 zeros under the v1 name
(vLLM PR 38966), and a symmetric zero is 8 either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.quantization.base import LinearMethod, QuantizationConfig
from kvscale.server.quantization.dense import DenseLinearMethod
from kvscale.server.quantization.int4 import Int4LinearMethod, int4_param
from kvscale.server.quantization.int4_formats import unpack_cols, unpack_gptq_zeros
from kvscale.server.quantization.layer_names import check_names_exist, is_skipped

PACK = 8
FORMATS = ("gptq", "gptq_v2")


class GptqConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, raw: dict[str, Any], model: ModelConfig) -> None:
        bits = raw.get("bits", 4)
        if bits != 4:
            raise CheckpointError(f"gptq checkpoint: {bits}-bit weights are not supported (only 4)")
        if raw.get("is_marlin_format"):
            raise CheckpointError(
                "gptq checkpoint: is_marlin_format is set: its weights are repacked for the "
                "Marlin kernel; kvscale loads the plain GPTQ layout (checkpoint_format "
                f"{' or '.join(FORMATS)})"
            )
        fmt = str(raw.get("checkpoint_format") or raw.get("format") or "gptq").lower()
        if fmt not in FORMATS:
            raise CheckpointError(
                f"gptq checkpoint: checkpoint_format {fmt!r} is a kernel-specific layout; "
                f"kvscale loads {' and '.join(FORMATS)}"
            )
        if raw.get("lm_head"):
            raise CheckpointError(
                "gptq checkpoint: a quantized lm_head (lm_head: true) is not supported"
            )
        if raw.get("dynamic"):
            raise CheckpointError(
                "gptq checkpoint: per-module overrides (dynamic) are not supported"
            )
        group = int(raw.get("group_size", 128))
        if group != -1 and group < 1:
            raise CheckpointError(f"gptq checkpoint: group_size must be -1 or > 0, got {group}")
        self.group_size = None if group == -1 else group
        self.act_order = bool(raw.get("desc_act", False)) and self.group_size is not None
        self.sym = bool(raw.get("sym", True))
        self.v1 = fmt == "gptq"
        self.skip = list(raw.get("modules_to_not_convert") or [])
        check_names_exist(self.skip, model, "modules_to_not_convert")

    def linear_method(self, prefix: str) -> LinearMethod:
        if is_skipped(prefix, lambda n: any(s in n for s in self.skip), "modules_to_not_convert"):
            return DenseLinearMethod()
        return GptqLinearMethod(self.group_size, self.act_order, self.sym, self.v1)

    def describe(self) -> str:
        g = f"groups of {self.group_size}" if self.group_size else "per-channel"
        parts = [g, "symmetric" if self.sym else "zero points", "v1" if self.v1 else "v2"]
        if self.act_order:
            parts.append("act-order")
        return f"gptq 4-bit weights ({', '.join(parts)}), 16-bit activations"


class GptqLinearMethod(Int4LinearMethod):
    def __init__(self, group_size: int | None, act_order: bool, sym: bool, v1: bool) -> None:
        super().__init__(group_size, act_order, what="gptq checkpoint")
        self.sym = sym
        self.v1 = v1

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        self.check_divisible(in_features, "the input features per rank")
        for shard in layer.output_partition_sizes:
            self.check_divisible(shard, "each output shard")
        groups, split = self.groups(layer, in_features)
        g_dim = 0 if split else None
        layer.register_parameter(
            "qweight",
            int4_param(
                in_features // PACK,
                out_features,
                input_dim=0,
                output_dim=1,
                packed_dim=0,
                pack_factor=PACK,
            ),
        )
        layer.register_parameter(
            "qzeros",
            int4_param(
                groups,
                out_features // PACK,
                input_dim=g_dim,
                output_dim=1,
                packed_dim=1,
                pack_factor=PACK,
            ),
        )
        layer.register_parameter(
            "scales",
            int4_param(groups, out_features, dtype=torch.float32, input_dim=g_dim, output_dim=1),
        )
        if self.act_order:
            layer.register_parameter("g_idx", int4_param(in_features, input_dim=0))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        k = layer.qweight.shape[0] * PACK
        n = layer.scales.shape[1]
        if self.sym:
            stored = set(unpack_cols(layer.qzeros.data, n).unique().tolist())
            if not stored <= {7} and not stored <= {8}:
                raise CheckpointError(
                    f"gptq checkpoint: sym is true but the qzeros of a layer hold "
                    f"{sorted(stored)[:8]}; a symmetric 4-bit zero is stored as 7 (v1) or 8 "
                    "(v2)"
                )
            zeros = None
        else:
            zeros = unpack_gptq_zeros(layer.qzeros.data, n, self.v1)
        g_idx = layer.g_idx.data if self.act_order else None
        drop = ("qweight", "qzeros", "scales", *(("g_idx",) if self.act_order else ()))
        # GPTQ's qweight is the kernel's packing already
        self.finish(layer, layer.qweight.data, k, layer.scales.data, zeros, g_idx, drop)
