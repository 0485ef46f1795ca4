"""Start-up calibration of an FP8 KV cache's per-layer scales, for checkpoints without them.

One prefill of a fixed text (``CALIBRATION_TEXT``, tokenized with the model's tokenizer by
``config``) runs through the model with the attention backend wrapped in
``KVScaleCalibration``: before a layer's K and V are written, that layer's scales are set
from their absolute maximum, ``scale = KV_SCALE_HEADROOM * absmax / 448``, so values up to
``KV_SCALE_HEADROOM`` times larger than any seen still fit (E4M3 keeps its relative
precision over 2**-6..448, so the headroom costs only values under ~1/7000 of the
absmax). Each layer is calibrated on the output of the layers before it, already reading
their quantized cache, as serving will. Unit scales are never used: vLLM measured what
they cost (Qwen2-7B perplexity 34.8 against 22.6 with computed scales, PR 11906).
"""

from __future__ import annotations

from typing import Any

import torch

from kvscale.kernels.fp8 import FP8_MAX
from kvscale.server.attention.backend import AttentionBackend
from kvscale.server.attention.metadata import AttentionMetadata
from kvscale.server.worker.kv_pool import LayerKV

KV_SCALE_HEADROOM = 4.0
_MIN_SCALE = 1e-8  # an all-zero layer (never in practice) still gets a usable scale

CALIBRATION_TEXT = (
    "The harbour town woke slowly. By six the fishing boats were back, gulls circling over "
    "crates of mackerel and cod, and the baker on Quay Street had sold his first two hundred "
    "loaves. Tourists arrived on the 9:15 ferry; most of them asked the same three questions. "
    "Where is the lighthouse? How far is the beach? Is the museum open on Mondays? "
    "In the library, a student copied a proof by hand: if n is even then n = 2k for some "
    "integer k, so n^2 = 4k^2 is divisible by 4. Next to her, a retired engineer read about "
    "tidal turbines, 1.5 MW each, anchored 40 metres below the surface. "
    "def moving_average(values, window):\n    total = sum(values[:window])\n    out = "
    "[total / window]\n    for i in range(window, len(values)):\n        total += values[i] "
    "- values[i - window]\n        out.append(total / window)\n    return out\n"
    "Q: What is the capital of Australia? A: Canberra, not Sydney, as many people assume. "
    "Q: Translate 'good morning' into French. A: Bonjour. Q: Summarise the plot of Hamlet in "
    "one sentence. A: A Danish prince feigns madness to avenge his father's murder, and "
    "nearly everyone dies. Weather for tomorrow: cloudy, 14-17 degrees, wind from the "
    "south-west at 20 km/h, a 30% chance of rain after 4 pm."
)
NUM_RANDOM_IDS = 512  # without a tokenizer (tests), seeded random ids calibrate instead


def calibration_ids(tokenizer: Any, vocab_size: int) -> tuple[int, ...]:
    """The calibration prompt's token ids (``CALIBRATION_TEXT`` repeated to ~1,000 tokens),
    or seeded random ids when there is no tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return tuple(torch.randint(0, vocab_size, (NUM_RANDOM_IDS,), generator=g).tolist())
    ids = list(tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))
    ids = [i for i in ids if 0 <= i < vocab_size]
    return tuple((ids * 4)[:1024])


def kv_scale(x: torch.Tensor) -> torch.Tensor:
    """The fp32 scale (``[]``) for values like ``x``."""
    return (x.abs().amax().float() * (KV_SCALE_HEADROOM / FP8_MAX)).clamp_min(_MIN_SCALE)


class KVScaleCalibration(AttentionBackend):
    """``inner`` with each layer's scales set from the K/V it is about to write."""

    name = "kv-scale-calibration"
    headroom = KV_SCALE_HEADROOM

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv: LayerKV, meta: AttentionMetadata
    ) -> None:
        kv.k_scale.copy_(kv_scale(k))
        kv.v_scale.copy_(kv_scale(v))
        self.inner.write_kv(k, v, kv, meta)

    def attend(
        self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return self.inner.attend(q, kv, meta, scale)
