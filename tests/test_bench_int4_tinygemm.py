"""CPU tests of bench/int4_tinygemm.py: the weights it hands each kernel, built as its
``main`` builds them from ``[N, K]`` codes, are the same weights (no GPU)."""

from __future__ import annotations

import torch

from kvscale.kernels.w4a16 import dequantize_w4, pack_int4_rows, w4a16_gemm_ref
from kvscale.server.quantization.int4 import tinygemm_pack, tinygemm_scales
from tests.bench_scripts import load_bench

it = load_bench("int4_tinygemm")


def test_both_layouts_give_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k, group = 64, 256, it.GROUP
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8)
    g = torch.arange(k) // group
    w = (codes.float() - zeros.float().t()[:, g]) * scales.t()[:, g]  # [N, K], by hand
    q = pack_int4_rows(codes.t())
    torch.testing.assert_close(dequantize_w4(q, scales, zeros, group, k).t(), w)
    x = torch.randn(2, k, generator=gen)
    want = x @ w.t()
    torch.testing.assert_close(
        w4a16_gemm_ref(x, q, scales, zeros, group), want, atol=1e-5, rtol=1e-5
    )
    tiny = torch.ops.aten._weight_int4pack_mm_for_cpu(  # the CPU twin of the GPU kernel
        x.to(torch.bfloat16), tinygemm_pack(codes), group, tinygemm_scales(scales, zeros)
    )
    assert ((tiny.float() - want).norm() / want.norm()).item() < 1e-2


def test_every_tile_config_holds_the_8b_layers() -> None:
    from kvscale.kernels.testing import LLAMA_8B_LINEARS
    from kvscale.kernels.w4a16_tiles import tiles_fit

    assert it.TILES and all(name.startswith("m16") for name in it.TILES)
    for cfg in it.TILES.values():
        assert all(tiles_fit(k, it.GROUP, cfg) for _, k, _ in LLAMA_8B_LINEARS), cfg
