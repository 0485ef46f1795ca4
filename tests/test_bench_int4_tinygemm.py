"""CPU tests of bench/int4_tinygemm.py: both kernels' inputs hold the same weights (no GPU)."""

from __future__ import annotations

import torch

from kvscale.kernels.w4a16 import w4a16_gemm_ref
from kvscale.server.quantization.int4 import tinygemm_pack, tinygemm_scales
from tests.bench_scripts import load_bench

it = load_bench("int4_tinygemm")


def test_both_layouts_give_the_dequantized_product() -> None:
    gen = torch.Generator().manual_seed(0)
    n, k, group = 64, 256, it.GROUP
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8)
    x = torch.randn(2, k, generator=gen)
    want = x @ it.dequant(codes, scales, zeros).t()
    ours = w4a16_gemm_ref(x, it.pack_gptq(codes), scales, zeros, group)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=1e-5)
    tiny = torch.ops.aten._weight_int4pack_mm_for_cpu(  # the CPU twin of the GPU kernel
        x.to(torch.bfloat16), tinygemm_pack(codes), group, tinygemm_scales(scales, zeros)
    )
    assert ((tiny.float() - want).norm() / want.norm()).item() < 1e-2
