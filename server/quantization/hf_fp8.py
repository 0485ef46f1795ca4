"""Hugging Face ``fp8`` checkpoints (``quant_method: fp8``, transformers' FineGrainedFP8):
block-wise FP8 weights as DeepSeek-V3 and Qwen3's FP8 releases publish them.

Each quantized linear layer holds ``weight [out, in]`` in FP8 E4M3 and
``weight_scale_inv [ceil(out / bn), ceil(in / bk)]`` fp32, one scale per ``bn x bk``
weight block (``weight_block_size``, usually 128 x 128; ``w ~ weight * scale``).
Activations are quantized on the fly per token and group of ``bk`` columns
(``activation_scheme: dynamic``), and the block-scaled GEMM (``kernels.fp8_gemm``) applies
both scales inside its K loop. Layers named in ``modules_to_not_convert`` stay dense
(matched as transformers does: a prefix, a regex or a name suffix).
"""

from __future__ import annotations

import re
from typing import Any

from kvscale.server.config import CheckpointError
from kvscale.server.quantization.base import LinearMethod, QuantizationConfig
from kvscale.server.quantization.dense import DenseLinearMethod
from kvscale.server.quantization.fp8 import Fp8BlockLinearMethod

# our fused layer -> the checkpoint's layers it holds
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(
        f"fp8 checkpoint: {what}; supported: block-wise FP8 E4M3 weights "
        "(weight_block_size [bn, bk]) with dynamic activations"
    )


def not_converted(name: str, patterns: list[str]) -> bool:
    """transformers' rule for ``modules_to_not_convert``: a pattern naming a prefix of
    ``name`` (as a regex), or a suffix of it."""
    return any(re.match(f"{p}\\.", name) or re.match(p, name) or name.endswith(p) for p in patterns)


class HfFp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, raw: dict[str, Any]) -> None:
        block = raw.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise _refuse(f"weight_block_size {block!r} (per-tensor FP8 is not supported)")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise _refuse(f"activation_scheme {raw.get('activation_scheme')!r}")
        if raw.get("fmt", "e4m3") != "e4m3":
            raise _refuse(f"fmt {raw.get('fmt')!r}")
        if raw.get("scale_fmt") not in (None, "float"):
            raise _refuse(f"scale_fmt {raw.get('scale_fmt')!r} (ue8m0 scales)")
        self.block = (int(block[0]), int(block[1]))
        self.skip = list(raw.get("modules_to_not_convert") or [])

    def linear_method(self, prefix: str) -> LinearMethod:
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{part}" for part in _FUSED.get(leaf, (leaf,))]
        skipped = {not_converted(n, self.skip) for n in names}
        if len(skipped) > 1:
            raise _refuse(f"modules_to_not_convert splits the fused layer {prefix}")
        if skipped.pop():
            return DenseLinearMethod()
        return Fp8BlockLinearMethod(self.block)

    def describe(self) -> str:
        bn, bk = self.block
        return f"fp8: {bn}x{bk} block weight scales, dynamic per-token-group activations"
