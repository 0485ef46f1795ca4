"""Checkpoints written by llm-compressor (``quant_method: compressed-tensors``).

Supported now: the ``float-quantized`` format with FP8 E4M3 weights (``strategy``
``channel`` or ``tensor``, symmetric, static) and FP8 activations (``dynamic`` per
``token``, or static per ``tensor`` with an ``input_scale``); the ``pack-quantized``
format with 4-bit int weights and 16-bit activations (W4A16, ``compressed_tensors_w4a16``);
on layers matched by the ``Linear`` target, with an ``ignore`` list (names or ``re:``
patterns, in the checkpoint's own layer names) left dense. A ``kv_cache_scheme`` (an FP8
KV cache with per-layer scales) is the KV cache's business (``quantization.kv_cache``).
Anything else (weight-only FP8, block strategies, 8-bit packing, sparsity) is refused with
what was found and what is supported.
"""

from __future__ import annotations

import re
from typing import Any

from kvscale.server.config import CheckpointError
from kvscale.server.quantization.base import LinearMethod, QuantizationConfig
from kvscale.server.quantization.compressed_tensors_w4a16 import (
    CompressedTensorsW4A16Method,
    W4A16Scheme,
    parse_w4a16,
)
from kvscale.server.quantization.dense import DenseLinearMethod
from kvscale.server.quantization.fp8 import Fp8LinearMethod
from kvscale.server.quantization.layer_names import is_skipped


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(
        f"compressed-tensors checkpoint: {what}; supported: format float-quantized with FP8 "
        "weights (channel or tensor scales) and FP8 activations (dynamic per token or "
        "static per tensor), format pack-quantized with 4-bit int weights (group or channel "
        "scales) and 16-bit activations"
    )


def _fp8(args: dict[str, Any] | None, what: str) -> dict[str, Any]:
    if not args:
        raise _refuse(f"{what} are not quantized (weight-only FP8 is not supported)")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise _refuse(f"{what}: {args.get('num_bits')}-bit {args.get('type')} is not supported")
    if not args.get("symmetric", True):
        raise _refuse(f"{what}: asymmetric FP8 is not supported")
    return args


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, raw: dict[str, Any]) -> None:
        fmt = raw.get("format")
        if raw.get("sparsity_config"):
            raise _refuse("sparsity_config is not supported")
        groups = list((raw.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise _refuse(f"{len(groups)} config groups (only one is supported)")
        group = groups[0]
        if group.get("format", fmt) not in ("float-quantized", "pack-quantized"):
            raise _refuse(f"format {group.get('format', fmt)!r}")
        if group.get("targets") != ["Linear"]:
            raise _refuse(f"targets {group.get('targets')!r} (only ['Linear'])")
        self.ignore = list(raw.get("ignore") or [])
        self.w4a16: W4A16Scheme | None = None
        if group.get("format", fmt) == "pack-quantized":
            self.w4a16 = parse_w4a16(group, _refuse)
            return
        w = _fp8(group.get("weights"), "weights")
        if w.get("dynamic") or w.get("strategy") not in ("channel", "tensor"):
            raise _refuse(f"weight strategy {w.get('strategy')!r} (dynamic={w.get('dynamic')})")
        a = _fp8(group.get("input_activations"), "activations")
        if a.get("dynamic") and a.get("strategy") == "token":
            static = False
        elif not a.get("dynamic") and a.get("strategy") == "tensor":
            static = True
        else:
            raise _refuse(
                f"activation strategy {a.get('strategy')!r} with dynamic={a.get('dynamic')}"
            )
        self.per_channel = w["strategy"] == "channel"
        self.static_input = static

    def _ignored(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name):
                    return True
            elif pattern == name:
                return True
        return False

    def linear_method(self, prefix: str) -> LinearMethod:
        if is_skipped(prefix, self._ignored, "compressed-tensors checkpoint: the ignore list"):
            return DenseLinearMethod()
        if self.w4a16 is not None:
            return CompressedTensorsW4A16Method(self.w4a16)
        return Fp8LinearMethod(self.per_channel, self.static_input)

    def describe(self) -> str:
        if self.w4a16 is not None:
            return self.w4a16.describe()
        w = "per-channel" if self.per_channel else "per-tensor"
        a = "static per-tensor" if self.static_input else "dynamic per-token"
        return f"compressed-tensors FP8: {w} weight scales, {a} activations"
