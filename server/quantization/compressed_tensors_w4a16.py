"""compressed-tensors ``pack-quantized`` 4-bit weights with 16-bit activations (W4A16,
as llm-compressor's GPTQ and AWQ modifiers write them, schemes W4A16 and W4A16_ASYM).

Tensors per layer: ``weight_packed [N, K/8]`` int32 (codes offset by +8 from the signed
values), ``weight_scale [N, G]``, ``weight_zero_point [N/8, G]`` int32 packed along the
outputs (asymmetric schemes), ``weight_g_idx [K]`` (act-order ``group``, written by older
versions), ``weight_shape`` (ignored: the packed shapes are checked). Strategies:
``group`` (``group_size`` inputs per group) and ``channel`` (one group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvscale.server.quantization.int4 import Int4LinearMethod, int4_param
from kvscale.server.quantization.int4_formats import unpack_ct_zeros

PACK = 8
SUPPORTED = (
    "pack-quantized with 4-bit int weights (strategy group or channel, symmetric or not, "
    "actorder none/weight/group) and unquantized activations"
)


@dataclass(frozen=True)
class W4A16Scheme:
    group_size: int | None  # None: per channel
    sym: bool
    act_order: bool  # the checkpoint carries weight_g_idx

    def describe(self) -> str:
        g = f"groups of {self.group_size}" if self.group_size else "per-channel"
        z = "symmetric" if self.sym else "zero points"
        return f"compressed-tensors W4A16: 4-bit weights ({g}, {z}), 16-bit activations"


def parse_w4a16(group: dict[str, Any], refuse: Any) -> W4A16Scheme:
    """A config group of format pack-quantized -> its scheme; ``refuse(what)`` makes the
    error for anything else."""
    w = group.get("weights") or {}
    if group.get("input_activations"):
        raise refuse("pack-quantized weights with quantized activations (W4A8) are not supported")
    if w.get("type") != "int" or w.get("num_bits") != 4:
        raise refuse(
            f"pack-quantized {w.get('num_bits')}-bit {w.get('type')} weights are not "
            f"supported ({SUPPORTED})"
        )
    if w.get("dynamic"):
        raise refuse("dynamic weight quantization is not supported")
    strategy = w.get("strategy")
    if strategy == "group":
        size = w.get("group_size")
        if not isinstance(size, int) or size < 1:
            raise refuse(f"strategy group needs a positive group_size, got {size!r}")
    elif strategy == "channel":
        size = None
    else:
        raise refuse(f"pack-quantized weight strategy {strategy!r} ({SUPPORTED})")
    actorder = w.get("actorder")
    if actorder not in (None, "weight", "static", "group", "dynamic"):
        raise refuse(f"actorder {actorder!r}")
    # "weight"/"static" only changed the order GPTQ visited columns: no g_idx is stored
    act_order = actorder in ("group", "dynamic") and size is not None
    return W4A16Scheme(size, bool(w.get("symmetric", True)), act_order)


class CompressedTensorsW4A16Method(Int4LinearMethod):
    def __init__(self, scheme: W4A16Scheme) -> None:
        super().__init__(scheme.group_size, scheme.act_order, "compressed-tensors checkpoint")
        self.sym = scheme.sym

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        self.check_divisible(in_features, "the input features per rank")
        if not self.sym:
            for shard in layer.output_partition_sizes:
                self.check_divisible(shard, "each output shard (zero points are packed)")
        groups, split = self.groups(layer, in_features)
        g_dim = 1 if split else None
        layer.register_parameter(
            "weight_packed",
            int4_param(
                out_features,
                in_features // PACK,
                output_dim=0,
                input_dim=1,
                packed_dim=1,
                pack_factor=PACK,
            ),
        )
        layer.register_parameter(
            "weight_scale",
            int4_param(out_features, groups, dtype=torch.float32, output_dim=0, input_dim=g_dim),
        )
        if not self.sym:
            layer.register_parameter(
                "weight_zero_point",
                int4_param(
                    out_features // PACK,
                    groups,
                    output_dim=0,
                    input_dim=g_dim,
                    packed_dim=0,
                    pack_factor=PACK,
                ),
            )
        if self.act_order:
            layer.register_parameter("weight_g_idx", int4_param(in_features, input_dim=0))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        n, words = layer.weight_packed.shape
        qweight = layer.weight_packed.data.t().contiguous()  # [N, K/8] -> the kernel's [K/8, N]
        scales = layer.weight_scale.data.t()
        zeros = None if self.sym else unpack_ct_zeros(layer.weight_zero_point.data, n)
        g_idx = layer.weight_g_idx.data if self.act_order else None
        drop = ["weight_packed", "weight_scale"]
        drop += [] if self.sym else ["weight_zero_point"]
        drop += ["weight_g_idx"] if self.act_order else []
        self.finish(layer, qweight, words * PACK, scales, zeros, g_idx, tuple(drop))
