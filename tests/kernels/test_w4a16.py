"""The W4A16 GEMM against its torch reference, and the reference against the layout's
definition computed element by element."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscale.kernels import w4a16
from kvscale.kernels.testing import LLAMA_8B_LINEARS, kernel_dtypes, on_native_gpu, tolerances
from kvscale.kernels.w4a16 import (
    dequantize_w4,
    pack_int4_rows,
    unpack_int4_rows,
    w4a16_config,
    w4a16_gemm,
    w4a16_gemm_ref,
)

gpu_only = pytest.mark.skipif(not on_native_gpu(), reason="needs CUDA without the interpreter")
SHAPES_8B = [(k, n) for _, k, n in LLAMA_8B_LINEARS]  # (K, N)


def _weights(
    k: int,
    n: int,
    group_size: int,
    device: torch.device,
    asym: bool = True,
    act_order: bool = False,
) -> dict[str, torch.Tensor | int | None]:
    """Random codes, scales and zeros; act-order: rows sorted by a random group
    assignment of equal-size groups, with the permutation that undoes it."""
    groups = -(-k // group_size)
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    scales = torch.rand(groups, n) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (groups, n), dtype=torch.uint8) if asym else None
    perm = None
    if act_order:
        perm = torch.randperm(k).int()
    return {
        "qweight": pack_int4_rows(codes).to(device),
        "scales": scales.to(device),
        "zeros": zeros.to(device) if zeros is not None else None,
        "group_size": group_size,
        "perm": perm.to(device) if perm is not None else None,
        "codes": codes,
    }


def _run(
    m: int,
    k: int,
    n: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    config: dict[str, int] | None = None,
    **kw: bool,
) -> None:
    w = _weights(k, n, group_size, device, **kw)
    codes = w.pop("codes")
    x = torch.randn(m, k, dtype=dtype, device=device)
    got = w4a16_gemm(x, **w, config=config)  # type: ignore[arg-type]
    ref = w4a16_gemm_ref(x, **w)  # type: ignore[arg-type]
    cfg = config or w4a16_config(m, n, k, device)
    groups = -(-k // group_size)
    if cfg.get("GEMV") and w4a16.gemv_fits(group_size, groups, cfg["BLOCK_K"], False):
        # the GEMV keeps each weight in fp32 (the tl.dot kernel and the reference round
        # it to x's dtype first): its reference is the fp32 product
        dense = dequantize_w4(w["qweight"], w["scales"], w["zeros"], group_size, k)  # type: ignore[arg-type]
        perm = w["perm"]
        xs = x.float() if perm is None else x.float()[:, perm.long()]  # type: ignore[union-attr]
        ref = (xs @ dense).to(dtype)
    assert got.shape == (m, n) and got.dtype == dtype
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, **tolerances(dtype))
    del codes


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("m", [1, 17])
def test_w4a16_matches_ref(
    dtype: torch.dtype, group_size: int, asym: bool, m: int, device: torch.device
) -> None:
    # K = 200: not a multiple of the K tile nor of the group size (last group partial)
    _run(m, 200, 72, group_size, dtype, device, asym=asym)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_w4a16_act_order_permutation(
    dtype: torch.dtype, group_size: int, device: torch.device
) -> None:
    _run(7, 256, 48, group_size, dtype, device, asym=True, act_order=True)


@pytest.mark.parametrize("split", [1, 2, 3, 16])
@pytest.mark.parametrize("block_k,group_size", [(32, 64), (64, 32), (32, 48), (64, 128)])
def test_w4a16_group_modes_and_splits(
    split: int, block_k: int, group_size: int, device: torch.device
) -> None:
    """Every way a K tile meets its groups (one per tile, several, per row) with every
    split count, including more splits than K tiles."""
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4}
    _run(3, 232, 40, group_size, torch.float32, device, config=cfg)
    _run(3, 232, 40, group_size, torch.float16, device, config=cfg, asym=False)


@pytest.mark.parametrize("split", [1, 3, 16])
@pytest.mark.parametrize("block_k,group_size", [(32, 64), (64, 64), (32, 232), (128, 128)])
def test_w4a16_gemv_one_row(
    split: int, block_k: int, group_size: int, device: torch.device
) -> None:
    """The one-row kernel: tiles of one group (or one group in all), zero points or not,
    an act-order permutation, every split count, K and N whole tiles or not (the
    mask-free loop and the masked one)."""
    cfg = {"GEMV": 1, "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": block_k, "SPLIT_K": split}
    for dtype in kernel_dtypes():
        _run(1, 232, 40, group_size, dtype, device, config=cfg)
    _run(1, 232, 40, group_size, torch.float32, device, config=cfg, asym=False)
    _run(1, 232, 40, group_size, torch.float16, device, config=cfg, act_order=True)
    _run(1, 228, 40, group_size, torch.float32, device, config=cfg)  # a half-empty last word
    if group_size != 232:  # K = 256, N = 64: whole tiles
        _run(1, 256, 64, group_size, torch.float32, device, config=cfg)
        _run(1, 256, 64, group_size, torch.float16, device, config=cfg, act_order=True)


def test_w4a16_gemv_is_the_default_for_one_row_of_whole_groups(device: torch.device) -> None:
    dev = torch.device("cpu")
    assert w4a16_config(1, 4096, 4096, dev)["GEMV"] == 1
    assert "GEMV" not in w4a16_config(2, 4096, 4096, dev)
    assert not w4a16.gemv_fits(64, 64, 128, False)  # two groups in one 128-row tile
    assert w4a16.gemv_fits(128, 32, 128, False) and not w4a16.gemv_fits(128, 32, 128, True)
    assert w4a16.gemv_fits(64, 64, 64, False)  # groups of 64 fit the GEMV's 64-row tiles
    with pytest.raises(ValueError, match="GEMV needs one row"):
        _run(2, 256, 32, 128, torch.float32, device, config={"GEMV": 1, "BLOCK_M": 1,
             "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1})  # fmt: skip


def test_w4a16_channelwise_and_k_not_multiple_of_8(device: torch.device) -> None:
    for k in (200, 132):  # 132: the last packed word is half empty
        _run(4, k, 24, k, torch.float32, device)  # one group: per-channel scales
        _run(4, k, 24, 32, torch.float32, device, asym=False)


def test_w4a16_g_idx_with_unequal_groups(device: torch.device) -> None:
    """A rank's slice of an act-order layer: rows sorted by group, but groups of unequal
    sizes (and some absent), so each row looks its group up."""
    k, n, groups = 96, 40, 7
    g_idx = torch.sort(torch.randint(0, groups, (k,))).values.int()
    codes = torch.randint(0, 16, (k, n), dtype=torch.uint8)
    scales = torch.rand(groups, n) + 0.1
    zeros = torch.randint(0, 16, (groups, n), dtype=torch.uint8)
    perm = torch.randperm(k).int()
    args = [pack_int4_rows(codes), scales, zeros, 32, perm, g_idx]
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    x = torch.randn(9, k, device=device)
    ref = w4a16_gemm_ref(x, *args)
    torch.testing.assert_close(w4a16_gemm(x, *args), ref, **tolerances(torch.float32))
    # the reference itself, written out: x[:, perm] @ ((codes - zero[g]) * scale[g])
    w = (codes.float() - zeros[g_idx.long()].float()) * scales[g_idx.long()]
    torch.testing.assert_close(ref.cpu(), x.cpu()[:, perm.long()] @ w, rtol=1e-5, atol=1e-5)


def test_pack_int4_rows_matches_the_layout_bytewise() -> None:
    """Bits 4j..4j+3 of word r hold row 8r+j: read back through the little-endian bytes
    (byte b holds rows 2b (low nibble) and 2b+1 (high nibble))."""
    codes = torch.randint(0, 16, (27, 5), dtype=torch.uint8)
    words = pack_int4_rows(codes)
    assert words.shape == (4, 5) and words.dtype == torch.int32
    raw = np.ascontiguousarray(words.numpy().T).astype("<i4").view(np.uint8)  # [N, 16]
    nibbles = np.stack([raw & 0xF, raw >> 4], axis=-1).reshape(5, -1)[:, :27]
    assert np.array_equal(nibbles.T, codes.numpy())
    assert torch.equal(unpack_int4_rows(words, 27), codes)


def test_dequantize_follows_the_formula() -> None:
    codes = torch.randint(0, 16, (20, 6), dtype=torch.uint8)
    scales = torch.rand(3, 6)
    zeros = torch.randint(0, 16, (3, 6), dtype=torch.uint8)
    w = dequantize_w4(pack_int4_rows(codes), scales, zeros, 8, 20)
    for k in range(20):
        for n in range(6):
            want = (int(codes[k, n]) - int(zeros[k // 8, n])) * float(scales[k // 8, n])
            assert abs(float(w[k, n]) - want) < 1e-6
    sym = dequantize_w4(pack_int4_rows(codes), scales, None, 8, 20)
    torch.testing.assert_close(sym, (codes.float() - 8) * scales.repeat_interleave(8, 0)[:20])


def test_bad_shapes_are_named(device: torch.device) -> None:
    w = _weights(64, 16, 32, device)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="scales"):
        w4a16_gemm(x, w["qweight"], w["scales"][:1], None, 32)  # type: ignore[index]
    with pytest.raises(ValueError, match="qweight"):
        w4a16_gemm(torch.randn(2, 72, device=device), w["qweight"], w["scales"], None, 32)


def test_empty_batch(device: torch.device) -> None:
    w = _weights(64, 16, 32, device)
    w.pop("codes")
    out = w4a16_gemm(torch.empty(0, 64, device=device), **w)  # type: ignore[arg-type]
    assert out.shape == (0, 16)


@pytest.mark.parametrize("gemv", [0, 1])
@pytest.mark.parametrize("split", [2, 3, 16])
def test_split_k_in_one_kernel_equals_the_sum_kernel(
    gemv: int, split: int, device: torch.device
) -> None:
    """The last split to arrive sums the partials in split order: the same bits as the
    separate sum kernel, the tile counters back at zero after every call, and again
    on the next calls (the counters are shared by every product on the device)."""
    w = _weights(256, 96, 64, device)
    w.pop("codes")
    cfg = {"GEMV": gemv, "BLOCK_M": 1 if gemv else 16, "BLOCK_N": 32, "BLOCK_K": 32,
           "SPLIT_K": split, "num_warps": 4}  # fmt: skip
    if not gemv:
        del cfg["GEMV"]
    for m in [1] if gemv else [1, 5, 19]:
        for _ in range(3):
            x = torch.randn(m, 256, dtype=torch.float16, device=device)
            one = w4a16_gemm(x, **w, config=cfg)  # type: ignore[arg-type]
            assert int(w4a16.arrival_counters(x.device).abs().sum()) == 0
            two = w4a16_gemm(x, **w, config={**cfg, "FIXUP": 0})  # type: ignore[arg-type]
            torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_config_splits_decode_and_not_prefill() -> None:
    dev = torch.device("cpu")
    sms = w4a16.num_sms(dev)
    decode = w4a16_config(1, 64, 4096, dev)
    assert decode["SPLIT_K"] > 1  # a few output tiles: K is split to occupy the SMs
    assert w4a16_config(4096, 4096, 4096, dev)["SPLIT_K"] == 1
    assert w4a16._split_plan(200, 32, 16) == (32, 7)  # never an empty split
    assert w4a16._split_plan(4096, 128, 3) == (1408, 3)
    assert sms >= 1


def test_gemv_takes_256_rows_of_k_a_program_where_that_still_fills_the_sms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a 132-SM H100 (leases r22-r24's sweeps): 128 rows of K a program for qkv and o,
    256 for gate_up and down, in 128-row tiles where the groups allow (64 otherwise)."""
    monkeypatch.setattr(w4a16, "is_interpreter", lambda: False)
    monkeypatch.setattr(w4a16, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    splits = {(k, n): w4a16_config(1, n, k, dev)["SPLIT_K"] for k, n in SHAPES_8B}
    assert splits == {(4096, 6144): 32, (4096, 4096): 32, (4096, 28672): 16, (14336, 4096): 56}
    for block_k in (128, 64):
        by_k = {(k, n): w4a16_config(1, n, k, dev, gemv_block_k=block_k)["SPLIT_K"]
                for k, n in SHAPES_8B}  # fmt: skip
        assert by_k == splits  # the same rows of K a program in tiles of 64
    cfg = w4a16_config(1, 4096, 4096, dev)
    assert (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]) == (256, 128, 2)
    assert w4a16.gemv_block_k(128, 32, False) == 128
    assert w4a16.gemv_block_k(64, 64, False) == 64
    assert w4a16.gemv_block_k(32, 128, False) is None  # two groups in every 64-row tile
    assert w4a16.gemv_block_k(w4a16.ONE_GROUP, 1, False) == 128


def test_symmetric_gemvs_share_rows_of_eights_that_are_never_freed() -> None:
    dev = torch.device("cpu")
    row = w4a16._symmetric_zero_row(dev, 100)
    assert row.dtype == torch.uint8 and row.numel() >= 100 and bool((row == 8).all())
    assert w4a16._symmetric_zero_row(dev, 50) is row  # one row serves every narrower product
    wider = w4a16._symmetric_zero_row(dev, row.numel() + 1)
    assert wider is not row and wider.numel() > row.numel()
    assert any(r is row for r in w4a16._SYMMETRIC_ZEROS[dev])  # kept: graphs hold its address


# ---- GPU: the 8B model's shapes, CUDA graphs ------------------------------------------


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("k,n", SHAPES_8B)
def test_w4a16_8b_shapes_gpu(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    _run(m, k, n, 128, dtype, torch.device("cuda"), asym=m % 2 == 0)


@gpu_only
def test_w4a16_act_order_8b_gpu() -> None:
    _run(16, 4096, 4096, 128, torch.bfloat16, torch.device("cuda"), act_order=True)


@gpu_only
@pytest.mark.parametrize("m", [1, 4])
def test_w4a16_replays_in_a_cuda_graph(m: int) -> None:
    """A split-K decode product (the GEMV, the tile kernel) captured in a CUDA graph and
    replayed with new input gives the eager result (no host sync or allocation outside
    the graph's pool)."""
    dev = torch.device("cuda")
    w = _weights(4096, 4096, 128, dev)
    w.pop("codes")
    x = torch.randn(m, 4096, dtype=torch.bfloat16, device=dev)
    assert w4a16_config(m, 4096, 4096, dev)["SPLIT_K"] > 1
    w4a16_gemm(x, **w)  # type: ignore[arg-type]  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gemm(x, **w)  # type: ignore[arg-type]
    for _ in range(50):  # the split-K arrivals race differently on every replay
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, w4a16_gemm(x, **w), rtol=0, atol=0)  # type: ignore[arg-type]
    assert int(w4a16.arrival_counters(dev).abs().sum()) == 0
