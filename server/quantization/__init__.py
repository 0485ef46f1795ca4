"""How each linear layer stores and multiplies its weight: the linear-method seam.

A checkpoint's ``quantization_config`` (or the ``quantization`` setting) selects a
``QuantizationConfig``, which gives each linear layer its ``LinearMethod``; without one
every layer is dense (``DenseLinearMethod``). A checkpoint quantized in a format the
engine does not implement is refused at load (``CheckpointError``), never loaded as if
it were dense.
"""

from __future__ import annotations

from kvscale.server.config import CheckpointError, ModelConfig
from kvscale.server.quantization.base import LinearMethod, QuantizationConfig, set_weight_attrs
from kvscale.server.quantization.dense import DenseLinearMethod

__all__ = [
    "DenseLinearMethod",
    "LinearMethod",
    "QuantizationConfig",
    "get_quantization",
    "set_weight_attrs",
]

SUPPORTED: tuple[str, ...] = ()  # quant_method values implemented so far


def get_quantization(model: ModelConfig, requested: str | None) -> QuantizationConfig | None:
    """The checkpoint's quantization (None: dense). Raises CheckpointError for a format
    that is not implemented, or a ``requested`` method the checkpoint does not have."""
    method = (model.quantization or {}).get("quant_method")
    if method is None:
        if requested not in (None, "none"):
            raise CheckpointError(
                f"quantization={requested!r} was asked for, but the checkpoint is not "
                "quantized (its config.json has no quantization_config)"
            )
        return None
    raise CheckpointError(
        f"the checkpoint is quantized with quant_method={method!r}, which kvscale cannot "
        f"load yet (supported: {', '.join(SUPPORTED) or 'none so far'}); loading it as "
        "dense weights would produce garbage"
    )
