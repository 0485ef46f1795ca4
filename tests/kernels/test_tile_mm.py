"""The tiled GEMM against the fp32 product of its operands: odd shapes (rows, columns and
K off the tiles), FP8 with row and channel scales, the TMA's loads, strided rows, and the
errors a caller can act on."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.fp8 import FP8_E4M3
from kvscale.kernels.testing import kernel_dtypes, on_native_gpu, rel_error
from kvscale.kernels.tile_mm import TileConfig, tile_mm, tile_mm_ref, tma_fits

# small tiles for the interpreter; on a GPU the configs the engine and bench run
SMALL = (TileConfig(16, 32, 64, 4, 1), TileConfig(32, 16, 64, 4, 2, tma=True))
GPU = (
    TileConfig(64, 128, 128, 4, 4),
    TileConfig(128, 128, 128, 8, 4),
    TileConfig(128, 64, 128, 4, 4, tma=True),
    TileConfig(256, 128, 128, 8, 3, tma=True),
)
CONFIGS = GPU if on_native_gpu() else SMALL


def _limit(dtype: torch.dtype) -> float:
    # the output's rounding (16-bit) or fp32's sums in another order
    return 1e-5 if dtype == torch.float32 else 4e-3


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (37, 80, 128), (70, 33, 96), (130, 256, 320)])
def test_matches_the_fp32_product(device, dtype, config, m, n, k) -> None:
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = tile_mm(x, w, config=config)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_error(out, x.float() @ w.float().t()) < _limit(dtype)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k", [(5, 64, 128), (37, 96, 256), (130, 200, 384)])
def test_fp8_scales_rows_and_channels(device, out_dtype, config, m, n, k) -> None:
    x = torch.randn(m, k, device=device).to(FP8_E4M3)
    w = torch.randn(n, k, device=device).to(FP8_E4M3)
    # scales spread over decades: a scale applied to the wrong row or column shows
    xs = torch.logspace(-3, 1, m, device=device)[torch.randperm(m, device=device)]
    ws = torch.logspace(-2, 2, n, device=device)[torch.randperm(n, device=device)]
    out = tile_mm(x, w, xs, ws, out_dtype=out_dtype, config=config)
    ref = (x.float() @ w.float().t()) * xs[:, None] * ws[None, :]
    # FP8 products are exact in fp32; Hopper's tensor cores accumulate them in ~14 bits
    limit = 2.0**-8 if on_native_gpu() else (1e-5 if out_dtype == torch.float32 else 1e-3)
    assert rel_error(out, ref) < limit
    assert torch.equal(tile_mm_ref(x, w, xs, ws, out_dtype=torch.float32), ref)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_strided_rows_and_empty_inputs(device, config) -> None:
    dtype = torch.float16
    big = torch.randn(9, 192, device=device).to(dtype)
    x = big[:, :128]  # rows 192 apart: a view, not copied
    w = torch.randn(40, 128, device=device).to(dtype)
    assert rel_error(tile_mm(x, w, config=config), x.float() @ w.float().t()) < 4e-3
    assert tile_mm(x[:0], w, config=config).shape == (0, 40)
    empty_k = tile_mm(x[:, :0], w[:, :0], config=config)
    assert empty_k.shape == (9, 40) and not empty_k.float().abs().sum()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_writes_into_a_given_buffer(device, config) -> None:
    x = torch.randn(6, 64, device=device).half()
    w = torch.randn(40, 64, device=device).half()
    buffer = torch.full((8, 40), 7.0, device=device).half()
    out = tile_mm(x, w, config=config, out=buffer[:6])
    assert out.data_ptr() == buffer.data_ptr()
    assert rel_error(buffer[:6], x.float() @ w.float().t()) < 4e-3
    assert (buffer[6:] == 7).all()  # rows past M untouched
    with pytest.raises(ValueError, match=r"out must be \[6, 40\]"):
        tile_mm(x, w, config=config, out=buffer[:5])
    with pytest.raises(ValueError, match="unit column stride"):
        tile_mm(x, w, config=config, out=torch.empty(40, 6, device=device).half().t())


def test_tma_rule(device) -> None:
    x = torch.randn(8, 64, device=device).half()
    assert tma_fits(x, x)
    assert not tma_fits(x[:, 1:], x)  # base off 16 bytes
    assert not tma_fits(torch.randn(8, 65, device=device).half()[:, :64], x)  # 130-byte rows


def test_errors_say_what_is_allowed(device) -> None:
    x = torch.randn(4, 32, device=device).half()
    with pytest.raises(ValueError, match="one K"):
        tile_mm(x, torch.randn(8, 16, device=device).half())
    with pytest.raises(ValueError, match="share a dtype"):
        tile_mm(x, torch.randn(8, 32, device=device))
    q = x.to(FP8_E4M3)
    with pytest.raises(ValueError, match="scales are given with FP8"):
        tile_mm(q, q)
    with pytest.raises(ValueError, match="scales are given with FP8"):
        tile_mm(x, x, torch.ones(4, device=device), torch.ones(4, device=device))
    ones = torch.ones(4, device=device)
    with pytest.raises(ValueError, match="x_scale must hold 4"):
        tile_mm(q, q, ones[:3], ones, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="need an out_dtype"):
        tile_mm(q, q, ones, ones)
    with pytest.raises(ValueError, match="bf16, fp16, fp32"):
        i = torch.ones(4, 32, dtype=torch.int32, device=device)
        tile_mm(i, i)
