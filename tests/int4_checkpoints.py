"""4-bit test checkpoints.

- ``oneshot_int4``: llm-compressor (the real tool) writes compressed-tensors W4A16
  checkpoints with its GPTQ or AWQ modifier, on CPU in seconds for the tiny models.
- ``write_awq``/``write_gptq``: the same quantized weights rewritten in the legacy AutoAWQ
  GEMM and GPTQ layouts, with transcriptions of those projects' published packing loops
  (AutoAWQ ``WQLinear_GEMM.from_linear``, AutoGPTQ ``QuantLinear.pack``, and GPTQModel's
  whole-word v2 -> v1 zero-point conversion), not kvscale's packers.
- ``write_rtn``: round-to-nearest checkpoints of a dense one, act-order among them (a
  random input order per layer, groups taken in that order: a ``g_idx``), in the GPTQ,
  AWQ or compressed-tensors (older ``weight_g_idx``) layout, with a dense checkpoint of
  the same dequantized weights as the reference (transformers cannot run them on CPU).
- ``bytes_unpack_rows``/``bytes_unpack_cols``: an unpacker independent of kvscale's
  shifts, reading nibbles from each little-endian int32's bytes as the formats describe
  them (byte ``b`` holds nibbles ``2b`` and ``2b + 1``).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .quantized_checkpoints import CALIBRATION, calibration_set

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map for 4 bits


# ---- llm-compressor ----------------------------------------------------------------------
@contextlib.contextmanager
def _no_pinning() -> Iterator[None]:
    """llm-compressor's AWQ pins cached activations, which needs an accelerator on this
    torch; on a CPU-only machine the pinning is skipped (it only speeds up transfers)."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    saved = IntermediatesCache.__dict__["_pin_intermediate"]
    IntermediatesCache._pin_intermediate = classmethod(lambda cls, value: None)  # type: ignore[assignment]
    try:
        yield
    finally:
        IntermediatesCache._pin_intermediate = saved


def oneshot_int4(
    src: Path, dst: Path, modifier: str, sym: bool, group_size: int | None = 128
) -> Path:
    """llm-compressor ``oneshot`` with its ``GPTQModifier``, ``AWQModifier`` (then
    ``QuantizationModifier``) or ``QuantizationModifier`` alone (``rtn``: round to
    nearest) writing 4-bit int weights (``group_size`` None: per channel),
    ``lm_head`` left dense; saved compressed (pack-quantized) with ``src``'s tokenizer."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights: dict[str, Any] = {"num_bits": 4, "type": "int", "symmetric": sym}
    weights.update(
        {"strategy": "group", "group_size": group_size} if group_size else {"strategy": "channel"}
    )
    quant = dict(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}}, ignore=["lm_head"]
    )
    data: dict[str, Any] = dict(
        dataset=calibration_set(),
        num_calibration_samples=CALIBRATION["num_samples"],
        max_seq_length=CALIBRATION["seq_len"],
    )
    if modifier == "gptq":
        recipe: list[Any] = [GPTQModifier(**quant)]
    elif modifier == "awq":
        # a coarser scale search than the default 20 points: seconds instead of tens
        recipe = [AWQModifier(duo_scaling=False, n_grid=5), QuantizationModifier(**quant)]
    elif modifier == "rtn":  # round to nearest, no calibration data
        recipe, data = [QuantizationModifier(**quant)], {}
    else:
        raise ValueError(modifier)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with _no_pinning():
        oneshot(model=model, recipe=recipe, **data)
    model.save_pretrained(dst, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


# ---- reading checkpoints ----------------------------------------------------------------
def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def ct_layers(path: Path) -> dict[str, dict[str, torch.Tensor | None]]:
    """Each quantized layer of a pack-quantized checkpoint, unpacked with
    compressed-tensors' own ``unpack_from_int32``: ``codes [K, N]`` (0..15),
    ``scales [G, N]``, ``zeros [G, N]`` (None: symmetric)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    t = read_tensors(path)
    layers: dict[str, dict[str, torch.Tensor | None]] = {}
    for name in t:
        if not name.endswith(".weight_packed"):
            continue
        mod = name.removesuffix(".weight_packed")
        n, k = (int(v) for v in t[f"{mod}.weight_shape"])
        signed = unpack_from_int32(t[name], 4, torch.Size((n, k)))
        scales = t[f"{mod}.weight_scale"]
        zp = t.get(f"{mod}.weight_zero_point")
        zeros = None
        if zp is not None:
            z = unpack_from_int32(zp, 4, torch.Size((n, scales.shape[1])), packed_dim=0)
            zeros = (z.int() + 8).t().contiguous().to(torch.uint8)
        layers[mod] = {
            "codes": (signed.int() + 8).t().contiguous().to(torch.uint8),
            "scales": scales.t().contiguous().float(),
            "zeros": zeros,
        }
    return layers


def dequantize(layer: dict[str, torch.Tensor | None], g_idx: torch.Tensor | None = None):
    """``[N, K]`` float weight of an unpacked layer: ``(code - zero) * scale``."""
    codes, scales, zeros = layer["codes"], layer["scales"], layer["zeros"]
    assert codes is not None and scales is not None
    k = codes.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k) // -(-k // scales.shape[0])
    z = zeros.float()[g_idx.long()] if zeros is not None else 8.0
    return ((codes.float() - z) * scales[g_idx.long()]).t().contiguous()


def _copy_rest(src: Path, dst: Path, quant: dict[str, Any] | None) -> dict[str, Any]:
    """dst gets src's tokenizer files and config.json with ``quant`` as its
    quantization_config (None: removed); returns the config."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quant is not None:
        cfg["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg


def _dense_and_other(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors that are not part of a quantized layer's weight."""
    drop = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape")
    return {k: v for k, v in tensors.items() if not k.endswith(drop)}


# ---- AutoAWQ ------------------------------------------------------------------------------
def autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ ``WQLinear_GEMM.from_linear``'s packing loop: ``[R, C]`` codes (weights
    ``[in, out]`` or zeros ``[groups, out]``) -> ``[R, C/8]`` int32."""
    intweight = intweight.to(torch.int32)
    pack_num = 8
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // pack_num), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + AWQ_ORDER_MAP[i]]
            qweight[:, col] |= qweight_col << (i * 4)
    return qweight


def write_awq(ct: Path, dst: Path, group_size: int, skip: list[str] | None = None) -> Path:
    """The AutoAWQ GEMM layout of a pack-quantized checkpoint's weights (symmetric ones
    get zero points 8). Layers whose name contains an entry of ``skip`` are written dense
    (their dequantized weights) and listed in ``modules_to_not_convert``."""
    out = _dense_and_other(read_tensors(ct))
    for mod, layer in ct_layers(ct).items():
        if skip and any(s in mod for s in skip):
            out[f"{mod}.weight"] = dequantize(layer)
            continue
        codes, scales, zeros = layer["codes"], layer["scales"], layer["zeros"]
        assert codes is not None and scales is not None
        if zeros is None:
            zeros = torch.full(scales.shape, 8, dtype=torch.uint8)
        out[f"{mod}.qweight"] = autoawq_pack(codes)
        out[f"{mod}.qzeros"] = autoawq_pack(zeros)
        out[f"{mod}.scales"] = scales.half()  # AutoAWQ stores fp16 scales
    quant = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": skip,
    }
    _copy_rest(ct, dst, quant)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


# ---- GPTQ ---------------------------------------------------------------------------------
def autogptq_pack_qweight(intweight: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ ``QuantLinear.pack``'s qweight loop: codes ``[in, out]`` -> ``[in/8, out]``
    (``in`` a multiple of 32, as AutoGPTQ requires)."""
    iw = intweight.numpy().astype(np.uint32)
    qweight = np.zeros((iw.shape[0] // 32 * 4, iw.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= iw[j] << (4 * (j - i))
        i += 8
        row += 1
    return torch.from_numpy(qweight.astype(np.int32))


def autogptq_pack_qzeros(zeros: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qzeros loop, v1: ``zeros -= 1`` per element, then packed along the
    outputs (a multiple of 32). A zero point of 0 becomes -1 and corrupts its word
    (AutoGPTQ's known asymmetric bug): callers check there is none."""
    z = (zeros.to(torch.int64) - 1).numpy().astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // 32 * 4), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= z[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return torch.from_numpy(qzeros.astype(np.int32))


def gptqmodel_v2_to_v1(qzeros_v2: torch.Tensor) -> torch.Tensor:
    """GPTQModel's ``convert_gptq_v2_to_v1_format`` for 4 bits: ``qzeros -= 0x11111111``
    on whole int32 words (wrapping, borrows carried), so a zero of 0 survives."""
    w = qzeros_v2.numpy().astype(np.uint32)
    return torch.from_numpy((w - np.uint32(0x11111111)).astype(np.int32))


def pack_qzeros_v2(zeros: torch.Tensor) -> torch.Tensor:
    """v2 qzeros: AutoGPTQ's loop without the minus one."""
    return autogptq_pack_qzeros(zeros.to(torch.int64) + 1)


def _gptq_tensors(
    layer: dict[str, torch.Tensor | None], v1: bool, g_idx: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    codes, scales, zeros = layer["codes"], layer["scales"], layer["zeros"]
    assert codes is not None and scales is not None
    if zeros is None:
        zeros = torch.full(scales.shape, 8, dtype=torch.uint8)
    qzeros = pack_qzeros_v2(zeros)
    k = codes.shape[0]
    if g_idx is None:
        g_idx = torch.arange(k) // -(-k // scales.shape[0])
    return {
        "qweight": autogptq_pack_qweight(codes),
        "qzeros": gptqmodel_v2_to_v1(qzeros) if v1 else qzeros,
        "scales": scales.half(),
        "g_idx": g_idx.int(),
    }


def _gptq_config(group_size: int, sym: bool, v1: bool, desc_act: bool) -> dict[str, Any]:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
    }


def write_gptq(ct: Path, dst: Path, group_size: int, v1: bool) -> Path:
    """The GPTQ layout (``v1``: ``checkpoint_format: gptq``, zero points minus one;
    else ``gptq_v2``) of a pack-quantized checkpoint's weights; ``sym`` as the source."""
    out = _dense_and_other(read_tensors(ct))
    layers = ct_layers(ct)
    for mod, layer in layers.items():
        out.update({f"{mod}.{k}": v for k, v in _gptq_tensors(layer, v1, None).items()})
    sym = all(layer["zeros"] is None for layer in layers.values())
    _copy_rest(ct, dst, _gptq_config(group_size, sym, v1, desc_act=False))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def relabel(src: Path, dst: Path, **patch: Any) -> Path:
    """A copy of ``src`` whose quantization_config has ``patch`` applied."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(patch)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


# ---- round to nearest (act order) ---------------------------------------------------------
def write_rtn(
    dense: Path,
    dst: Path,
    ref: Path,
    layout: str,
    group_size: int,
    sym: bool,
    act_order: bool = True,
    seed: int = 0,
) -> tuple[Path, Path]:
    """A 4-bit checkpoint of the dense checkpoint ``dense``, quantized by round-to-nearest
    (``int4_formats.quantize_rtn``), and in ``ref`` a dense checkpoint of the dequantized
    weights (the reference where transformers cannot run the layout on CPU).

    ``act_order``: each layer's inputs are visited in a random order (one per layer input:
    q/k/v share theirs, as gate/up do) and grouped in that order (``g_idx[k]`` = position
    of input k in the order // group_size). ``layout``: ``gptq`` (v1; ``desc_act`` with
    act order), ``awq`` (no act order) or ``compressed-tensors`` (``weight_g_idx`` and
    actorder group with act order, written by compressed-tensors' own packer). Needs
    neither llm-compressor nor compressed-tensors for ``gptq`` and ``awq`` (GPU tests)."""
    from kvscale.server.quantization.int4_formats import quantize_rtn

    if layout == "awq" and act_order:
        raise ValueError("AWQ has no act order")
    g = torch.Generator().manual_seed(seed)
    tensors = read_tensors(dense)
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}
    for name, t in sorted(tensors.items()):
        mod, _, leaf = name.rpartition(".")
        if leaf != "weight" or mod.rpartition(".")[2] not in LINEARS:
            out[name] = deq[name] = t
            continue
        k = t.shape[1]
        g_idx = torch.arange(k) // group_size
        if act_order:
            # GPTQ orders a layer's inputs by the Hessian of its input, which q/k/v (and
            # gate/up) share, hence their order
            shared = mod.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            shared = shared.replace("up_proj", "gate_proj")
            order = orders.setdefault(shared, torch.randperm(k, generator=g))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // group_size
        codes, scales, zeros = quantize_rtn(t, group_size, sym, g_idx)
        if layout != "compressed-tensors":
            scales = scales.half().float()  # as stored: the reference uses the same values
        layer = {"codes": codes, "scales": scales, "zeros": None if sym else zeros}
        deq[name] = dequantize(layer, g_idx).to(t.dtype)
        if layout == "gptq":
            out.update({f"{mod}.{k_}": v for k_, v in _gptq_tensors(layer, True, g_idx).items()})
        elif layout == "awq":
            out[f"{mod}.qweight"] = autoawq_pack(codes)
            out[f"{mod}.qzeros"] = autoawq_pack(zeros)
            out[f"{mod}.scales"] = scales.half()
        else:
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            signed = (codes.t().contiguous().int() - 8).to(torch.int8)
            out[f"{mod}.weight_packed"] = pack_to_int32(signed, 4)
            out[f"{mod}.weight_scale"] = scales.t().contiguous()
            out[f"{mod}.weight_shape"] = torch.tensor(list(t.shape))
            if act_order:
                out[f"{mod}.weight_g_idx"] = g_idx.int()
            if not sym:
                zp = (zeros.t().contiguous().int() - 8).to(torch.int8)
                out[f"{mod}.weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
    if layout == "gptq":
        quant = _gptq_config(group_size, sym, v1=True, desc_act=act_order)
    elif layout == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                 "zero_point": True, "version": "gemm"}  # fmt: skip
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group",
                   "group_size": group_size, "actorder": "group" if act_order else None,
                   "dynamic": False}  # fmt: skip
        quant = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}
            },
            "ignore": ["lm_head"],
        }
    _copy_rest(dense, dst, quant)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_rest(dense, ref, None)
    save_file(deq, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return dst, ref


# ---- an independent unpacker --------------------------------------------------------------
def _nibbles(words: torch.Tensor) -> np.ndarray:
    """``[..., W]`` int32 -> ``[..., W, 8]`` nibbles, nibble i from byte i // 2 of the
    little-endian word (low half for even i)."""
    b = np.ascontiguousarray(words.numpy()).astype("<i4").view(np.uint8)
    b = b.reshape(*words.shape, 4)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*words.shape, 8)


def bytes_unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """``[K/8, N]`` words packed along rows (GPTQ qweight) -> ``[K, N]`` codes."""
    nib = _nibbles(words)  # [K/8, N, 8]
    return torch.from_numpy(nib.transpose(0, 2, 1).reshape(-1, words.shape[1]).copy())


def bytes_unpack_cols(words: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """``[R, C/8]`` words packed along columns -> ``[R, C]`` codes; ``order[i]`` is the
    column (within its eight) that nibble i holds (AWQ), in order when None."""
    nib = _nibbles(words)  # [R, C/8, 8]
    if order is not None:
        cols = np.empty_like(nib)
        cols[..., order] = nib
        nib = cols
    return torch.from_numpy(nib.reshape(words.shape[0], -1).copy())
