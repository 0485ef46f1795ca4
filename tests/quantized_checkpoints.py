"""Quantized test checkpoints made by the real tool, llm-compressor's ``oneshot`` (CPU,
seconds on the tiny models), from the random-weight checkpoints of ``demo_model``."""

from __future__ import annotations

from pathlib import Path

import torch

CALIBRATION = dict(num_samples=8, seq_len=32, seed=0)


def calibration_set() -> object:
    """Random token ids: static activation observers need some input (no dataset can be
    downloaded)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(CALIBRATION["seed"])
    n, length = CALIBRATION["num_samples"], CALIBRATION["seq_len"]
    ids = [torch.randint(3, 32000, (length,), generator=g).tolist() for _ in range(n)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * length] * n})


FP8_KV_CACHE_SCHEME = {
    "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
}  # fmt: skip


def compress(
    src: Path,
    dst: Path,
    scheme: str,
    ignore: tuple[str, ...] = ("lm_head",),
    kv_cache_scheme: dict[str, object] | None = None,
) -> Path:
    """``oneshot`` with a preset ``scheme`` (FP8_DYNAMIC, FP8, W4A16, ...) on ``src``,
    saved compressed to ``dst`` with ``src``'s tokenizer. ``kv_cache_scheme`` (e.g.
    ``FP8_KV_CACHE_SCHEME``) also calibrates per-layer K/V scales."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    recipe = QuantizationModifier(
        targets="Linear", scheme=scheme, ignore=list(ignore), kv_cache_scheme=kv_cache_scheme
    )
    kwargs: dict[str, object] = {}
    if scheme != "FP8_DYNAMIC" or kv_cache_scheme:
        kwargs = dict(
            dataset=calibration_set(),
            num_calibration_samples=CALIBRATION["num_samples"],
            max_seq_length=CALIBRATION["seq_len"],
        )
    oneshot(model=model, recipe=recipe, **kwargs)
    model.save_pretrained(dst, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def block_fp8(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> Path:
    """A Hugging Face ``fp8`` checkpoint of ``src`` in transformers' FineGrainedFP8 layout
    (as DeepSeek-V3 and Qwen3-FP8 publish): every linear ``*_proj.weight`` becomes FP8
    E4M3 with one ``weight_scale_inv`` (absmax / 448) per ``block`` tile; the rest, and
    ``lm_head``, stay as they are."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    bn, bk = block
    out: dict[str, torch.Tensor] = {}
    for name, w in load_file(src / "model.safetensors").items():
        if not (name.endswith("_proj.weight") and w.dim() == 2):
            out[name] = w
            continue
        n, k = w.shape
        tiles = w.float().reshape(n // bn, bn, k // bk, bk)
        amax = tiles.abs().amax(dim=(1, 3))
        inv = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (tiles / inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name] = q.reshape(n, k)
        out[name.removesuffix("weight") + "weight_scale_inv"] = inv
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [bn, bk],
        "modules_to_not_convert": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
