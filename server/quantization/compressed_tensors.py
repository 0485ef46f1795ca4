"""Checkpoints written by llm-compressor (``quant_method: compressed-tensors``).

Supported now: the ``float-quantized`` format with FP8 E4M3 weights (``strategy``
``channel`` or ``tensor``, symmetric, static) and FP8 activations (``dynamic`` per
``token``, or static per ``tensor`` with an ``input_scale``), on layers matched by the
``Linear`` target, with an ``ignore`` list (names or ``re:`` patterns, in the
checkpoint's own layer names) left dense. A ``kv_cache_scheme`` (an FP8 KV cache with
per-layer scales) is the KV cache's business (``quantization.kv_cache``). Anything else
(int4 packing, weight-only schemes, block or group strategies, sparsity) is refused with
what was found and what is supported.
"""

from __future__ import annotations

import re
from typing import Any

from kvscale.server.config import CheckpointError
from kvscale.server.quantization.base import LinearMethod, QuantizationConfig
from kvscale.server.quantization.dense import DenseLinearMethod
from kvscale.server.quantization.fp8 import Fp8LinearMethod

# our fused layer -> the checkpoint's layers it holds
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(
        f"compressed-tensors checkpoint: {what}; supported: format float-quantized with FP8 "
        "weights (channel or tensor scales) and FP8 activations (dynamic per token or "
        "static per tensor)"
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
        if group.get("format", fmt) != "float-quantized":
            raise _refuse(f"format {group.get('format', fmt)!r}")
        if group.get("targets") != ["Linear"]:
            raise _refuse(f"targets {group.get('targets')!r} (only ['Linear'])")
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
        self.ignore = list(raw.get("ignore") or [])

    def _ignored(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name):
                    return True
            elif pattern == name:
                return True
        return False

    def linear_method(self, prefix: str) -> LinearMethod:
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{part}" for part in _FUSED.get(leaf, (leaf,))]
        ignored = {self._ignored(n) for n in names}
        if len(ignored) > 1:
            raise _refuse(f"the ignore list splits the fused layer {prefix} ({', '.join(names)})")
        if ignored.pop():
            return DenseLinearMethod()
        return Fp8LinearMethod(self.per_channel, self.static_input)

    def describe(self) -> str:
        w = "per-channel" if self.per_channel else "per-tensor"
        a = "static per-tensor" if self.static_input else "dynamic per-token"
        return f"compressed-tensors FP8: {w} weight scales, {a} activations"
