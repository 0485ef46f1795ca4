"""How each linear layer stores and multiplies its weight: the linear-method seam.

A checkpoint's ``quantization_config`` (or the ``quantization`` setting) selects a
``QuantizationConfig``, which gives each linear layer its ``LinearMethod``; without one
every layer is dense (``DenseLinearMethod``). A checkpoint quantized in a format the
engine does not implement is refused at load (``CheckpointError``), never loaded as if
it were dense.
"""

from __future__ import annotations

from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.quantization.awq import AwqConfig
from kvscale.server.quantization.base import LinearMethod, QuantizationConfig, set_weight_attrs
from kvscale.server.quantization.compressed_tensors import CompressedTensorsConfig
from kvscale.server.quantization.dense import DenseLinearMethod
from kvscale.server.quantization.fp8 import Fp8OnlineLinearMethod
from kvscale.server.quantization.gptq import GptqConfig
from kvscale.server.quantization.hf_fp8 import HfFp8Config

__all__ = [
    "AwqConfig",
    "CompressedTensorsConfig",
    "DenseLinearMethod",
    "Fp8OnlineConfig",
    "GptqConfig",
    "HfFp8Config",
    "LinearMethod",
    "QuantizationConfig",
    "get_quantization",
    "set_weight_attrs",
]

SUPPORTED = (
    "compressed-tensors (FP8 float-quantized, W4A16 pack-quantized)",
    "awq (AutoAWQ GEMM, 4-bit)",
    "gptq (4-bit, v1 and v2)",
    "fp8 (block-wise FP8 checkpoints, or quantized at load from a dense one)",
)


class Fp8OnlineConfig(QuantizationConfig):
    """``quantization="fp8"`` on a dense checkpoint: every linear layer quantized at load."""

    name = "fp8"

    def linear_method(self, prefix: str) -> LinearMethod:
        return Fp8OnlineLinearMethod()

    def describe(self) -> str:
        return "fp8 at load: per-channel weight scales, dynamic per-token activations"


def get_quantization(model: ModelConfig, requested: str | None) -> QuantizationConfig | None:
    """The quantization to run ``model`` with (None: dense). ``requested``: the
    ``quantization`` setting (None or "auto": whatever the checkpoint says). Raises
    CheckpointError for a format that is not implemented, or a setting the checkpoint
    cannot honour, naming both."""
    raw = model.quantization or {}
    method = raw.get("quant_method")
    if method is None:
        if requested in (None, "auto", "none"):
            return None
        if requested == "fp8":
            return Fp8OnlineConfig()
        raise CheckpointError(
            f"quantization={requested!r} needs a checkpoint quantized that way; this one is "
            "dense (use quantization='fp8' to quantize it at load)"
        )
    if method == "compressed-tensors":
        ct = CompressedTensorsConfig(raw)
        config: QuantizationConfig = ct
        allowed = {None, "auto", method, "fp8" if ct.w4a16 is None else method}
    elif method == "awq":
        config, allowed = AwqConfig(raw, model), {None, "auto", method}
    elif method == "gptq":
        config, allowed = GptqConfig(raw, model), {None, "auto", method}
    elif method == "fp8":
        config, allowed = HfFp8Config(raw), {None, "auto", method}
    else:
        raise CheckpointError(
            f"the checkpoint is quantized with quant_method={method!r}, which kvscale cannot "
            f"load yet (supported: {', '.join(SUPPORTED)}); loading it as dense weights would "
            "produce garbage"
        )
    if requested not in allowed:
        raise CheckpointError(
            f"quantization={requested!r} does not match the checkpoint's {method!r} "
            f"({config.describe()})"
        )
    return config
