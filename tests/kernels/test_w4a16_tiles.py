"""The W4A16 tile kernel against the W4A16 reference (the weight dequantized in fp32):
odd shapes, one or several groups a tile, zero points or none, the words' nibble order,
and the layouts it refuses."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.testing import on_native_gpu, rel_error
from kvscale.kernels.tile_mm import TileConfig
from kvscale.kernels.w4a16 import pack_int4_rows, w4a16_gemm_ref
from kvscale.kernels.w4a16_tiles import (
    NIBBLE_ROWS,
    tiles_fit,
    transpose_words,
    w4a16_tiles,
)

# 128 and 64 rows of K a step under the interpreter; on a GPU the bench's candidates
SMALL = (TileConfig(16, 32, 64, 4, 1), TileConfig(16, 16, 32, 4, 2))
GPU = (TileConfig(16, 64, 128, 4, 4), TileConfig(16, 128, 128, 8, 3), TileConfig(32, 64, 64, 4, 4))
CONFIGS = GPU if on_native_gpu() else SMALL
DTYPES = [torch.float16, torch.bfloat16] if on_native_gpu() else [torch.float16]


def _layer(k: int, n: int, group: int, zero_points: bool, device):
    codes = torch.randint(0, 16, (k, n), dtype=torch.int32, device=device)
    groups = -(-k // group)
    scales = torch.rand(groups, n, device=device) * 0.02 + 0.005
    zeros = torch.randint(0, 16, (groups, n), dtype=torch.uint8, device=device)
    return pack_int4_rows(codes), scales, zeros if zero_points else None


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("zero_points", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize(
    "m,k,n,group",
    [(1, 256, 64, 128), (5, 512, 96, 32), (17, 384, 40, 384), (3, 256, 48, 64), (40, 512, 64, 512)],
)
def test_matches_the_reference(device, config, dtype, zero_points, m, k, n, group) -> None:
    qweight, scales, zeros = _layer(k, n, group, zero_points, device)
    if not tiles_fit(k, group, config):
        pytest.skip("groups that split this config's tiles")
    x = torch.randn(m, k, device=device).to(dtype)
    out = w4a16_tiles(x, transpose_words(qweight), scales, zeros, group, config)
    ref = w4a16_gemm_ref(x, qweight, scales, zeros, group)
    assert out.dtype == dtype and out.shape == (m, n)
    # 16-bit scales and products against fp32 dequantization rounded once
    assert rel_error(out, ref) < (2e-2 if dtype == torch.bfloat16 else 3e-3)


def test_the_words_hold_each_row_where_nibble_rows_says(device) -> None:
    codes = torch.randint(0, 16, (64, 24), dtype=torch.int32, device=device)
    words = transpose_words(pack_int4_rows(codes))  # [24, 8]
    assert words.shape == (24, 8) and words.is_contiguous()
    for q, j in enumerate(NIBBLE_ROWS):
        assert torch.equal((words >> (4 * q)) & 0xF, codes[j::8].t())
    assert sorted(NIBBLE_ROWS) == list(range(8))


def test_the_layouts_it_refuses(device) -> None:
    qweight, scales, _ = _layer(256, 40, 128, False, device)  # qweight [32, 40]
    words = transpose_words(qweight)
    x = torch.randn(2, 256, device=device).half()
    cfg = TileConfig(16, 32, 64, 4, 1)  # 128 rows a step
    assert tiles_fit(256, 128, cfg) and tiles_fit(256, 32, cfg) and not tiles_fit(256, 96, cfg)
    assert not tiles_fit(240, 128, cfg)  # K not a multiple of 32
    assert not tiles_fit(384, 48, cfg)  # 128 rows hold 2.67 groups
    with pytest.raises(ValueError, match="fp16 or bf16"):
        w4a16_tiles(x.float(), words, scales, None, 128, cfg)
    with pytest.raises(ValueError, match=r"words must be \[N, ceil\(K/8\) = 32\]"):
        w4a16_tiles(x, qweight, scales, None, 128, cfg)
    with pytest.raises(ValueError, match="does not fit tiles of 128 rows"):
        w4a16_tiles(x, words, scales, None, 96, cfg)
    with pytest.raises(ValueError, match=r"scales must be \[2, 40\]"):
        w4a16_tiles(x, words, scales[:1], None, 128, cfg)
    with pytest.raises(ValueError, match="zeros must match"):
        w4a16_tiles(x, words, scales, torch.zeros(1, 40, dtype=torch.uint8), 128, cfg)
