"""The 4-bit checkpoint layouts, both ways: packing (tests, benchmarks) and unpacking
(loading), and a round-to-nearest quantizer. Pure torch functions.

Codes are unsigned 4-bit values (0..15) with ``w = (code - zero) * scale``. Layouts, for
a linear layer of ``K`` inputs, ``N`` outputs and groups of ``g`` inputs:

- AutoAWQ GEMM (``quant_method: awq``): ``qweight [K, N/8]``, ``qzeros [K/g, N/8]``
  int32 packed along N in AWQ's interleaved order (nibble ``i`` of word ``c`` holds
  column ``8c + AWQ_ORDER[i]``), ``scales [K/g, N]``.
- GPTQ (``quant_method: gptq``): ``qweight [K/8, N]`` packed along K in order (nibble
  ``j`` of word row ``r`` is input row ``8r + j``), ``qzeros [K/g, N/8]`` packed along N
  in order, ``scales [K/g, N]``, ``g_idx [K]`` (input row -> group). The v1 checkpoint
  format (``checkpoint_format: gptq``) stores ``zero - 1`` by subtracting ``0x11111111``
  from each packed word (borrows included), v2 (``gptq_v2``) stores the zero itself.
- compressed-tensors ``pack-quantized``: ``weight_packed [N, K/8]`` packed along K in
  order, codes offset by +8 from the signed values; ``weight_zero_point [N/8, G]`` packed
  along N the same way (asymmetric schemes); ``weight_scale [N, G]``; ``weight_g_idx``.

The kernel's layout (``kvscale.kernels.w4a16``) is GPTQ's ``qweight`` layout.
"""

from __future__ import annotations

import torch

from kvscale.kernels.w4a16 import PACK, pack_int4_rows, unpack_int4_rows

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ word nibble i <- column 8c + AWQ_ORDER[i]
GPTQ_V1_OFFSET = 0x11111111  # v1 qzeros = v2 qzeros - this, per packed word


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values taken modulo 2^32, as signed int32."""
    words = words & 0xFFFFFFFF
    return (words - ((words >> 31) << 32)).to(torch.int32)


def pack_cols(codes: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[R, C]`` codes -> ``[R, ceil(C/8)]`` int32 packed along columns: nibble ``i`` of
    word ``c`` holds column ``8c + order[i]`` (in order when ``order`` is None)."""
    r, c = codes.shape
    words = torch.zeros(r, -(-c // PACK), dtype=torch.int32, device=codes.device)
    for i in range(PACK):
        col = order[i] if order is not None else i
        part = codes[:, col::PACK].to(torch.int32) & 0xF
        words[:, : part.shape[1]] |= part << (4 * i)
    return words


def unpack_cols(words: torch.Tensor, c: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_cols`: ``[R, ceil(C/8)]`` int32 -> ``[R, C]`` uint8 (one
    nibble at a time: no intermediate larger than the output)."""
    r, w = words.shape
    codes = torch.empty(r, w, PACK, dtype=torch.uint8, device=words.device)
    for i in range(PACK):
        col = order[i] if order is not None else i
        codes[:, :, col] = ((words >> (4 * i)) & 0xF).to(torch.uint8)
    return codes.view(r, w * PACK)[:, :c]


# ---- AWQ ---------------------------------------------------------------------------------
def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` codes (weights ``[K, N]`` or zeros ``[K/g, N]``) -> AWQ words."""
    return pack_cols(codes, AWQ_ORDER)


def unpack_awq(words: torch.Tensor, n: int) -> torch.Tensor:
    return unpack_cols(words, n, AWQ_ORDER)


# ---- GPTQ --------------------------------------------------------------------------------
def gptq_zeros_to_v1(qzeros_v2: torch.Tensor) -> torch.Tensor:
    """v2 packed zeros -> v1 (``zero - 1``), as GPTQ writers do on whole words."""
    return _to_int32(qzeros_v2.to(torch.int64) - GPTQ_V1_OFFSET)


def gptq_zeros_from_v1(qzeros_v1: torch.Tensor) -> torch.Tensor:
    """v1 packed zeros -> v2. Adding to the whole word undoes the writer's borrows, so a
    zero point of 0 (stored as 15 with a borrow from the next nibble) comes back as 0."""
    return _to_int32(qzeros_v1.to(torch.int64) + GPTQ_V1_OFFSET)


def pack_gptq(
    codes: torch.Tensor, zeros: torch.Tensor, v1: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[K, N]`` and zeros ``[G, N]`` -> (``qweight [K/8, N]``, ``qzeros [G, N/8]``)."""
    qzeros = pack_cols(zeros)
    return pack_int4_rows(codes), gptq_zeros_to_v1(qzeros) if v1 else qzeros


def unpack_gptq_zeros(qzeros: torch.Tensor, n: int, v1: bool) -> torch.Tensor:
    return unpack_cols(gptq_zeros_from_v1(qzeros) if v1 else qzeros, n)


# ---- compressed-tensors ------------------------------------------------------------------
def pack_ct(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[K, N]`` -> ``weight_packed [N, K/8]``."""
    return pack_int4_rows(codes).t().contiguous()


def unpack_ct(weight_packed: torch.Tensor, k: int) -> torch.Tensor:
    """``weight_packed [N, K/8]`` -> codes ``[K, N]``."""
    return unpack_int4_rows(weight_packed.t().contiguous(), k)


def pack_ct_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """Zeros ``[G, N]`` -> ``weight_zero_point [N/8, G]``."""
    return pack_int4_rows(zeros.t().contiguous())


def unpack_ct_zeros(zero_point: torch.Tensor, n: int) -> torch.Tensor:
    """``weight_zero_point [N/8, G]`` -> zeros ``[G, N]``."""
    return unpack_int4_rows(zero_point, n).t().contiguous()


# ---- quantizing --------------------------------------------------------------------------
def quantize_rtn(
    weight: torch.Tensor,
    group_size: int,
    sym: bool,
    g_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of ``weight [N, K]`` by groups of inputs, with
    GPTQ's min-max ranges: asymmetric ``scale = (max - min) / 15``, ``zero =
    round(-min / scale)``; symmetric ``scale = 2 * absmax / 15``, ``zero = 8``.

    ``g_idx [K]`` (act-order) assigns each input to its group; default ``k // group_size``.
    Returns codes ``[K, N]`` uint8, scales ``[G, N]`` fp32, zeros ``[G, N]`` uint8.
    """
    n, k = weight.shape
    w = weight.float().t()  # [K, N]
    if g_idx is None:
        g_idx = torch.arange(k, device=w.device) // group_size
    g_idx = g_idx.long()
    groups = int(g_idx.max()) + 1
    inf = torch.full((groups, n), float("inf"), device=w.device)
    lo = inf.scatter_reduce(0, g_idx[:, None].expand(k, n), w, "amin").clamp(max=0)
    hi = (-inf).scatter_reduce(0, g_idx[:, None].expand(k, n), w, "amax").clamp(min=0)
    if sym:
        hi = torch.maximum(hi, -lo)
        scales = (2 * hi / 15).clamp(min=1e-8)
        zeros = torch.full_like(scales, 8)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    codes = torch.round(w / scales[g_idx] + zeros[g_idx]).clamp(0, 15)
    return codes.to(torch.uint8), scales, zeros.to(torch.uint8)
