"""FP8 (E4M3) weights and activations: W8A8 linear layers on ``torch._scaled_mm``.

Weights are stored ``[out, in]`` in ``float8_e4m3fn`` with one fp32 scale per output
channel (per-tensor checkpoint scales are expanded to per-channel after loading, so
merged q/k/v or gate/up shards keep their own scales). Activations are quantized per
token (dynamic: ``absmax / 448`` per row) or with the checkpoint's static per-tensor
``input_scale``. The GEMM is ``torch._scaled_mm`` with row-wise scales (per-token x
per-channel) and fast accumulation (``FAST_ACCUM``), which cuBLASLt runs on Hopper and
torch runs on the CPU: one code path for both; on CUDA, with the ops routed to the
kernels, products of at most ``TILE_MAX_ROWS`` rows run ``kvscale.kernels.tile_mm``'s
16-row tiles instead (``uses_tiles``). Dense inputs of other dtypes are never silently
upcast: ``apply`` returns the input's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from kvscale.kernels.fp8 import FP8_E4M3 as FP8
from kvscale.kernels.fp8 import FP8_MAX, quantize_groups_ref
from kvscale.kernels.fp8_gemm import w8a8_block_matmul, w8a8_block_matmul_ref
from kvscale.kernels.tile_mm import TileConfig, tile_mm
from kvscale.server.config import CheckpointError
from kvscale.server.layers import ops
from kvscale.server.quantization.base import Fp8Activation, LinearMethod, set_weight_attrs

# Hopper's FP8 tensor cores accumulate in reduced precision unless told to promote
# partial sums: on an H100 (NOTES e35, bench/fp8_mm.py) letting them is 10-26% faster at
# 8,192 rows and 0-11% at 256, for a relative error of 2.1e-3 against 1.7e-3 (3.3e-3
# at K = 14,336); vLLM's Hopper FP8 GEMMs (CUTLASS, its sm90 ``FP8FastAccum`` schedules)
# accumulate this way. Ignored on the CPU.
FAST_ACCUM = True

# cuBLAS's row-wise FP8 kernels take 11-16 us for qkv and o at any row count up to 248
# and move gate_up's and down's weights at 49-70% of copy at 1-16 rows; 16-row tiles
# (mma on FP8 converted to fp16, fp32 sums: exact products) by the TMA took the 8B
# layers' GEMMs 0.81-0.86x cuBLAS's time at 1-16 rows on an H100, 0.97x at 32 and 1.26x
# at 64 (r102, bench/tile_mm_bench.py --configs small; NOTES e95).
TILE_MAX_ROWS = 16
# 128 columns a tile for gate_up-sized layers (43.4 against 49.9 us at one row), 64 for
# the rest, so that qkv's, o's and down's few columns still fill the SMs
TILE_WIDE_N = 16384


TILES_WIDE = TileConfig(16, 128, 256, num_warps=4, num_stages=3, tma=True)
TILES = TileConfig(16, 64, 256, num_warps=4, num_stages=4, tma=True)


def tile_config(n: int) -> TileConfig:
    """The tiles of a product with ``n`` output columns at up to ``TILE_MAX_ROWS`` rows."""
    return TILES_WIDE if n >= TILE_WIDE_N else TILES


def uses_tiles(x: torch.Tensor) -> bool:
    """Whether the FP8 codes ``x [T, K]`` go through the tiles (``ops.few_rows_on_kernels``
    at ``TILE_MAX_ROWS``)."""
    return ops.few_rows_on_kernels(x, TILE_MAX_ROWS)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``[M, K]`` FP8, ``[M, 1]`` fp32 scales): ``x ~ q * scale``,
    each row scaled by its absmax / 448 (the torch reference; weights at load time)."""
    return quantize_groups_ref(x, x.shape[-1])


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` with a per-tensor fp32 ``scale`` (shape ``[]``) -> FP8."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_input(
    x: torch.Tensor | Fp8Activation, group: int | None, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Size, torch.dtype]:
    """``x [..., K]`` as a GEMM's FP8 operand: (codes ``[T, K]``, fp32 scales, ``x``'s
    shape and 16-bit dtype). An ``Fp8Activation`` comes quantized already; a tensor is
    quantized here, per ``group`` columns of each token (None: all ``K``) or, given a
    static per-tensor ``input_scale``, with it."""
    if isinstance(x, Fp8Activation):
        return x.codes, x.scales, x.codes.shape, x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:  # one kernel on CUDA (ops routing)
        xq, xs = ops.fp8_quantize_groups(x2, group or x2.shape[-1])
    else:
        xq = quantize_static(x2, input_scale)
        xs = input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous()
    return xq, xs, x.shape, x.dtype


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K]`` (bf16/fp16/fp32) @ FP8 ``weight [N, K]`` (per-channel fp32
    ``weight_scale [N]``) -> ``[..., N]`` in ``x``'s dtype. ``input_scale`` (``[]``):
    static activation scale; None quantizes each token on the fly, or takes ``x``
    quantized so (an ``Fp8Activation [T, K]`` of one group a row)."""
    xq, xs, shape, dtype = fp8_input(x, None, input_scale)
    if uses_tiles(xq):
        y = tile_mm(xq, weight, xs, weight_scale, dtype, tile_config(weight.shape[0]))
    else:
        y = torch._scaled_mm(
            xq,
            weight.t(),
            scale_a=xs,
            scale_b=weight_scale.view(1, -1),
            out_dtype=dtype,
            use_fast_accum=FAST_ACCUM,
        )
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], weight.shape[0])


class Fp8LinearMethod(LinearMethod):
    """A layer of an FP8 checkpoint: ``weight`` FP8, ``weight_scale`` per channel
    (``[out, 1]``) or per tensor (one scalar per merged shard), optional static
    ``input_scale`` (one scalar per shard; their max is used)."""

    def __init__(self, per_channel: bool, static_input: bool) -> None:
        self.per_channel = per_channel
        self.static_input = static_input

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        shards = len(layer.output_partition_sizes)
        w = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(w, output_dim=0, input_dim=1))
        if self.per_channel:
            s = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(s, output_dim=0)
        else:
            s = nn.Parameter(torch.empty(shards, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(s, shard_scalar=True)
        layer.register_parameter("weight_scale", s)
        if self.static_input:
            i = nn.Parameter(torch.empty(shards, dtype=torch.float32), requires_grad=False)
            layer.register_parameter("input_scale", set_weight_attrs(i, shard_scalar=True))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = layer.weight_scale.data
        if self.per_channel:
            scale = scale.reshape(-1)
        else:  # one scalar per merged shard -> one per output channel
            sizes = layer.output_partition_sizes
            scale = torch.cat([s.expand(n) for s, n in zip(scale, sizes, strict=True)])
        layer.weight_scale = nn.Parameter(scale.contiguous(), requires_grad=False)
        if self.static_input:
            # q/k/v (gate/up) see the same input; checkpoints give each its own observer
            layer.input_scale = nn.Parameter(layer.input_scale.data.max(), requires_grad=False)

    def fp8_input_group(self, in_features: int) -> int | None:
        return None if self.static_input else in_features  # per token

    def apply(
        self, layer: nn.Module, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        input_scale = layer.input_scale if self.static_input else None
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, input_scale)


class Fp8OnlineLinearMethod(Fp8LinearMethod):
    """``--quantization fp8`` on a dense checkpoint: loads the dense weight, then
    quantizes it per output channel; activations are quantized per token."""

    def __init__(self) -> None:
        super().__init__(per_channel=True, static_input=False)

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(w, output_dim=0, input_dim=1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.reshape(-1), requires_grad=False)


@torch.library.custom_op("kvscale::w8a8_block_matmul", mutates_args=())
def _w8a8_block_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The block-scaled FP8 GEMM as one opaque op (torch.compile and the piecewise graphs
    keep it whole): the Triton kernel on CUDA, its torch reference elsewhere."""
    gemm = w8a8_block_matmul if a.is_cuda else w8a8_block_matmul_ref
    return gemm(a, a_scale, b, b_scale, (block_n, block_k), out_dtype)


@_w8a8_block_matmul.register_fake
def _(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


class Fp8BlockLinearMethod(LinearMethod):
    """Block-wise FP8 weights (Hugging Face ``fp8``): ``weight`` FP8 ``[out, in]`` and
    ``weight_scale_inv`` fp32 ``[out / bn, in / bk]``; activations quantized per token
    and group of ``bk`` columns; the block-scaled GEMM (``kvscale::w8a8_block_matmul``)."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype
    ) -> None:
        bn, bk = self.block
        sizes = layer.output_partition_sizes
        if any(n % bn for n in sizes) or in_features % bk:
            raise CheckpointError(
                f"a layer of {in_features} inputs and {sizes} outputs does not split into the "
                f"checkpoint's {bn}x{bk} weight blocks (per shard)"
            )
        w = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(w, output_dim=0, input_dim=1))
        s = torch.empty(out_features // bn, in_features // bk, dtype=torch.float32)
        # one stored row (column) per bn (bk) logical outputs (inputs): sharded like packing
        scale = set_weight_attrs(
            nn.Parameter(s, requires_grad=False),
            output_dim=0,
            input_dim=1,
            packed_dim=0,
            pack_factor=bn,
        )
        layer.register_parameter("weight_scale_inv", scale)

    def fp8_input_group(self, in_features: int) -> int | None:
        return self.block[1]

    def apply(
        self, layer: nn.Module, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None
    ) -> torch.Tensor:
        xq, xs, shape, dtype = fp8_input(x, self.block[1])
        y = torch.ops.kvscale.w8a8_block_matmul(
            xq, xs, layer.weight, layer.weight_scale_inv, *self.block, dtype
        )
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])
