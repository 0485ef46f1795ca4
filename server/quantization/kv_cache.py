"""The KV cache's dtype: the setting, the checkpoint's ``kv_cache_scheme`` and the model dtype.

``kv_cache_dtype``: ``auto`` keeps K and V in the model dtype unless the checkpoint was
quantized with an FP8 KV-cache scheme (llm-compressor's ``kv_cache_scheme``, which also
writes per-layer ``self_attn.k_scale``/``v_scale``), in which case the cache is FP8 with
those scales; ``fp8`` (or ``fp8_e4m3``) asks for an FP8 (E4M3) cache on any checkpoint:
with the checkpoint's scales when it has them, else with scales calibrated at start-up
(``worker.kv_calibration``). Scales are never silently 1.0.
"""

from __future__ import annotations

from typing import Any

import torch

from kvscale.kernels.fp8 import FP8_E4M3
from kvscale.server.config import CheckpointError, ModelConfig

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def checkpoint_kv_cache_dtype(model: ModelConfig) -> torch.dtype | None:
    """FP8 when the checkpoint declares an FP8 KV-cache scheme, None when it declares none;
    CheckpointError for a scheme kvscale does not implement."""
    scheme: dict[str, Any] | None = (model.quantization or {}).get("kv_cache_scheme")
    if not scheme:
        return None
    found = (
        scheme.get("num_bits"),
        scheme.get("type"),
        scheme.get("strategy"),
        bool(scheme.get("dynamic")),
        scheme.get("symmetric", True),
    )
    if found != (8, "float", "tensor", False, True):
        raise CheckpointError(
            f"kv_cache_scheme {scheme!r} is not supported; supported: 8-bit float, static, "
            "symmetric, one scale per tensor (llm-compressor's FP8 KV cache)"
        )
    return FP8_E4M3


def resolve_kv_cache_dtype(setting: str, model: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The cache dtype for the ``kv_cache_dtype`` setting, the checkpoint and the model
    ``dtype`` (see the module docstring)."""
    from_checkpoint = checkpoint_kv_cache_dtype(model)
    if setting == "auto":
        return from_checkpoint or dtype
    if setting in ("fp8", "fp8_e4m3"):
        return FP8_E4M3
    raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {setting!r}")
