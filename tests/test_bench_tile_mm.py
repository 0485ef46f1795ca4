"""CPU tests of bench/tile_mm_bench.py: its cuBLAS baselines compute the reference's
product (bf16, and FP8 with row and channel scales through torch's CPU ``_scaled_mm``),
its configs fit shared memory and step the 8B model's K, and its step summary."""

from __future__ import annotations

import torch

from kvscale.kernels.fp8 import FP8_E4M3
from tests.bench_scripts import load_bench

tb = load_bench("tile_mm_bench")


def test_the_baselines_compute_the_reference_product() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(48, 64)
    got = tb.cublas(x, None)(x, (w, None))
    torch.testing.assert_close(got, tb.reference(x, None, w, None))
    xq, wq = x.to(FP8_E4M3), w.to(FP8_E4M3)
    xs, ws = torch.rand(5) + 0.5, torch.rand(48) + 0.5
    got = tb.cublas(xq, xs)(xq, (wq, ws)).float()
    want = tb.reference(xq, xs, wq, ws)
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # bf16 output


def test_configs_fit_and_step_the_8b_layers_k() -> None:
    for name, configs in tb.CONFIGS.items():
        names = [c.name for c in configs]
        assert len(set(names)) == len(names), name
        for c in configs:
            assert tb.fits(c), c
            for dtype in (torch.bfloat16, FP8_E4M3):
                assert all(k % c.block_k(dtype) == 0 for k in (4096, 14336)), (c, dtype)


def test_the_step_summary_counts_each_layer_32_times_and_the_head_once() -> None:
    rows = [
        {"dtype": "bf16", "m": 1, "layer": layer, "variant": variant, "us": us}
        for layer, variant, us in (
            ("qkv", "cublas", 10.0), ("qkv", "tile", 8.0),
            ("head", "cublas", 300.0), ("head", "tile", 320.0),
        )
    ]  # fmt: skip
    (step,) = tb.summary(rows)
    assert step["cublas"] == (32 * 10.0 + 300.0) / 1e3
    assert step["best"] == (32 * 8.0 + 300.0) / 1e3
    assert step["ratio"] == step["best"] / step["cublas"]
