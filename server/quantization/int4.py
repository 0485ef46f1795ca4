"""4-bit weights, 16-bit activations (W4A16): what every 4-bit format shares.

A format's linear method (``awq.py``, ``gptq.py``, ``compressed_tensors_w4a16.py``)
creates its checkpoint's tensors with sharding metadata, and after loading hands the
unpacked codes, scales, zero points and group indices to :meth:`Int4LinearMethod.finish`,
which stores them in the one layout the GEMM reads (``kvscale.kernels.w4a16``):

- ``w4_qweight [ceil(K/8), N]`` int32, ``w4_scales [G, N]`` fp32 (checkpoint scales are
  fp16/bf16: fp32 keeps them exact), ``w4_zeros [G, N]`` uint8 or None (symmetric);
- act-order (a ``g_idx`` that is not ``k // group_size``): rows are sorted by group
  and ``w4_perm [K]`` says which activation column each row multiplies; when the sorted
  groups are not ``group_size`` rows each (a tensor-parallel rank's slice of an act-order
  layer), ``w4_g_idx [K]`` keeps each sorted row's group.

The GEMM is ``layers.ops.w4a16_gemm``: the Triton kernel where the worker routes ops to
the kernels (CUDA with the triton backend), its torch reference elsewhere (the CPU path,
the torch backend). Under ``torch.compile`` it is one opaque custom op,
``kvscale::w4a16_gemm`` (the kernel on CUDA, the reference elsewhere), so Inductor never
traces the dequantization.

Up to ``TINYGEMM_MAX_ROWS`` rows of bf16 activations on a CUDA GPU (small-batch decode
and verify steps), with the ops routed to the kernels, take PyTorch's own int4 kernel
instead (tinygemm, ``aten._weight_int4pack_mm``, as gpt-fast and torchao run it) where
its layout allows (:func:`tinygemm_fits`): at the 8B shapes on an H100 it takes 3-32%
less time a layer than the Triton GEMV at one row, and 22-54% less than the tl.dot
kernel at 2 and 4 rows (``bench/int4_tinygemm.py``, r57, r58). Such a layer also keeps
``w4_tiny`` (tinygemm's packing of the same codes) and ``w4_tiny_sz [G, N, 2]`` bf16
(scale, offset): ``w = (code - 8) * scale + offset``, ``offset = (8 - zero) * scale``.
That is a second copy of the codes (half a byte a weight), kept while the GPU's allocated
memory stays within ``TINYGEMM_MEMORY_SHARE`` of it (a model too large for it keeps the
Triton kernels in the layers past that point); ``KVSCALE_TINYGEMM=0`` leaves it out.

``kvscale.kernels.w4a16_tiles`` (16-row TMA tiles, two nibbles a ``lop3``) is not used
here: on an H100 it took 1.2-2.6x tinygemm's time a layer at 1-4 rows and lost C by 2x
(r107, NOTES "e99 measured").
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kvscale.kernels.w4a16 import pack_int4_rows, unpack_int4_rows, w4a16_gemm, w4a16_gemm_ref
from kvscale.server.config import CheckpointError
from kvscale.server.layers import ops
from kvscale.server.quantization.base import LinearMethod, set_weight_attrs

PACK = 8
TINYGEMM_GROUPS = (32, 64, 128, 256)
TINYGEMM_INNER_K_TILES = 8  # K must be a multiple of 16 times this
# rows that take tinygemm: at every 8B layer faster than the Triton kernels at 1, 2 and 4
# rows, slower at 8 on qkv, gate_up and down (r58, bench/int4_tinygemm.py)
TINYGEMM_MAX_ROWS = 4
# layers stop getting tinygemm's copy where it would take the GPU's allocated memory past
# this share of the GPU: a 4-bit model too large for a copy of its codes keeps its KV pool
TINYGEMM_MEMORY_SHARE = 0.35


@torch.library.custom_op("kvscale::w4a16_gemm", mutates_args=())
def w4a16_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> torch.Tensor:
    """``x [T, K]`` -> ``[T, N]``: the kernel on CUDA, the reference elsewhere."""
    gemm = w4a16_gemm if x.is_cuda else w4a16_gemm_ref
    return gemm(x, qweight, scales, zeros, group_size, perm, g_idx)


@w4a16_op.register_fake
def _(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], qweight.shape[1]))


def input_is_sharded(layer: nn.Module) -> bool:
    """True for a row-parallel layer split over more than one rank (its K is a slice)."""
    from kvscale.server.layers.linear import RowParallelLinear  # the layers import us

    return isinstance(layer, RowParallelLinear) and layer.parallel.world_size > 1


def int4_param(*shape: int, dtype: torch.dtype = torch.int32, **attrs: object) -> nn.Parameter:
    """An empty checkpoint tensor with its sharding metadata (``set_weight_attrs``)."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    return set_weight_attrs(p, **attrs)


def tinygemm_layout_fits(
    k: int, n: int, group_size: int, in_order: bool, dtype: torch.dtype
) -> bool:
    """Whether tinygemm's layout holds this layer: bf16 activations, groups of 32-256
    rows in checkpoint order (no act-order permutation or group index), K a multiple of
    128 and N of 8."""
    return (
        dtype == torch.bfloat16
        and in_order
        and group_size in TINYGEMM_GROUPS
        and k % (16 * TINYGEMM_INNER_K_TILES) == 0
        and n % 8 == 0
    )


def tinygemm_fits(
    k: int, n: int, group_size: int, in_order: bool, dtype: torch.dtype, device: torch.device
) -> bool:
    """:func:`tinygemm_layout_fits`, on a GPU of compute capability 8.0 or later, and
    ``KVSCALE_TINYGEMM`` is not ``0``."""
    return (
        tinygemm_layout_fits(k, n, group_size, in_order, dtype)
        and os.environ.get("KVSCALE_TINYGEMM", "1") != "0"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def tinygemm_copy_fits(allocated: int, copy_bytes: int, total: int) -> bool:
    """Whether a layer's copy (``copy_bytes``) keeps the GPU's allocated memory (bytes,
    this process's) within ``TINYGEMM_MEMORY_SHARE`` of its ``total``."""
    return allocated + copy_bytes <= TINYGEMM_MEMORY_SHARE * total


def tinygemm_scales(scales: torch.Tensor, zeros: torch.Tensor | None) -> torch.Tensor:
    """``scales [G, N]``, ``zeros [G, N]`` (None: 8) -> tinygemm's ``[G, N, 2]`` bf16
    (scale, offset) with ``(code - 8) * scale + offset == (code - zero) * scale``."""
    s = scales.float()
    offset = torch.zeros_like(s) if zeros is None else (8 - zeros.float()) * s
    return torch.stack([s, offset], dim=-1).to(torch.bfloat16).contiguous()


def tinygemm_pack(codes: torch.Tensor, inner_k_tiles: int = TINYGEMM_INNER_K_TILES) -> torch.Tensor:
    """``codes [N, K]`` (0..15) -> tinygemm's packed weight for the codes' device (CUDA:
    two codes a byte, the even column in the high nibble, then the op's tiling, K in
    tiles of ``16 * inner_k_tiles``; the CPU op takes the codes as int32)."""
    if codes.is_cuda:
        c = codes.to(torch.uint8)
        pairs = (c[:, ::2] << 4 | c[:, 1::2]).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        codes.to(torch.int32).contiguous(), inner_k_tiles
    )


class Int4LinearMethod(LinearMethod):
    """Base of the 4-bit formats: ``group_size`` inputs per group (None: one group per
    output channel), ``act_order``: the checkpoint carries a ``g_idx``."""

    def __init__(self, group_size: int | None, act_order: bool, what: str) -> None:
        self.group_size = group_size
        self.act_order = act_order
        self.what = what  # names the format in errors

    # ---- shapes -------------------------------------------------------------------------
    def groups(self, layer: nn.Module, in_features: int) -> tuple[int, bool]:
        """(groups stored on this rank, whether they split along K over ranks).

        Per-channel scales are never split. A row-parallel layer's groups split with its
        K, unless its rows are in act order: then any row may belong to any group and
        every rank holds all of them (as vLLM does)."""
        if self.group_size is None:
            return 1, False
        sharded = input_is_sharded(layer)
        if sharded and self.act_order:
            full = in_features * layer.parallel.world_size
            return -(-full // self.group_size), False
        if sharded and in_features % self.group_size:
            raise CheckpointError(
                f"{self.what}: {in_features} input features per rank is not a multiple of "
                f"the group size {self.group_size}; use a tensor-parallel size that divides "
                "the layer into whole groups"
            )
        return -(-in_features // self.group_size), sharded

    def check_divisible(self, features: int, what: str) -> None:
        if features % PACK:
            raise CheckpointError(
                f"{self.what}: {what} ({features}) must be a multiple of 8 to be packed "
                "eight to an int32"
            )

    # ---- after loading ------------------------------------------------------------------
    def finish(
        self,
        layer: nn.Module,
        qweight: torch.Tensor,
        k: int,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        g_idx: torch.Tensor | None,
        drop: tuple[str, ...],
    ) -> None:
        """Stores the kernel's layout on ``layer`` and removes the checkpoint tensors
        ``drop``. ``qweight [ceil(K/8), N]`` int32 packed along the inputs (the kernel's
        packing), ``scales``/``zeros [G, N]`` (zero points unpacked, uint8), ``g_idx [K]``
        (act order: rows are unpacked, sorted by group and repacked)."""
        group_size = self.group_size or k
        perm = None
        if g_idx is not None:
            g_idx = g_idx.long()
            lo, hi = int(g_idx.min()), int(g_idx.max())
            if g_idx.numel() != k or lo < 0 or hi >= scales.shape[0]:
                raise CheckpointError(
                    f"{self.what}: g_idx must give each of the {k} input rows a group in "
                    f"[0, {scales.shape[0]}), got {g_idx.numel()} values in [{lo}, {hi}]"
                )
            order = torch.sort(g_idx, stable=True).indices
            g_idx = g_idx[order]
            if not torch.equal(order, torch.arange(k, device=order.device)):
                qweight = pack_int4_rows(unpack_int4_rows(qweight, k)[order])
                perm = order.to(torch.int32)
            plain = torch.arange(k, device=g_idx.device) // group_size
            if scales.shape[0] == -(-k // group_size) and torch.equal(g_idx, plain):
                g_idx = None
            else:
                g_idx = g_idx.to(torch.int32)
        for name in drop:
            delattr(layer, name)
        layer.w4_qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.w4_scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        layer.w4_zeros = (
            None if zeros is None else nn.Parameter(zeros.contiguous(), requires_grad=False)
        )
        layer.w4_perm = None if perm is None else nn.Parameter(perm, requires_grad=False)
        layer.w4_g_idx = None if g_idx is None else nn.Parameter(g_idx, requires_grad=False)
        layer.w4_group_size = group_size
        in_order = perm is None and g_idx is None
        layer.w4_tiny = layer.w4_tiny_sz = None
        n, device = qweight.shape[1], qweight.device
        fits = tinygemm_fits(k, n, group_size, in_order, layer.params_dtype, device)
        if fits and tinygemm_copy_fits(
            torch.cuda.memory_allocated(device),
            n * k // 2 + scales.shape[0] * n * 4,
            torch.cuda.get_device_properties(device).total_memory,
        ):
            codes = unpack_int4_rows(qweight, k).t()
            layer.w4_tiny = nn.Parameter(tinygemm_pack(codes), requires_grad=False)
            sz = tinygemm_scales(scales, zeros)
            layer.w4_tiny_sz = nn.Parameter(sz, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        tiny = layer.w4_tiny is not None and ops.routed_to_kernels()
        if tiny and x.dim() == 2 and 0 < x.shape[0] <= TINYGEMM_MAX_ROWS:
            y = torch.ops.aten._weight_int4pack_mm(
                x.contiguous(), layer.w4_tiny, layer.w4_group_size, layer.w4_tiny_sz
            )
            return y if bias is None else y + bias
        args = (
            layer.w4_qweight,
            layer.w4_scales,
            layer.w4_zeros,
            layer.w4_group_size,
            layer.w4_perm,
            layer.w4_g_idx,
        )
        if torch.compiler.is_compiling():
            y = torch.ops.kvscale.w4a16_gemm(x, *args)
        else:
            y = ops.w4a16_gemm(x, *args)
        return y if bias is None else y + bias
