"""The FP8 (E4M3) KV cache paths of the kernels against their torch references: the write
quantizes bit for bit as ``Tensor.to(float8_e4m3fn)`` does, and decode/prefill attention
read FP8 blocks with per-layer scales. Under the Triton interpreter the FP8 tiles are
read and upcast exactly as on the GPU (the write rounds in fp32 arithmetic, see
``kernels/fp8.py``); natively the same tests run in bf16 too."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kvscale.kernels.fp8 import FP8_E4M3, quantize_e4m3, quantize_fp8_ref
from kvscale.kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from kvscale.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from kvscale.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref
from kvscale.kernels.testing import (
    kernel_dtypes,
    on_native_gpu,
    random_paged_kv,
    rel_error,
    tolerances,
)


def _scale(x: float, device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=device)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
def test_fp8_write_matches_torch_bit_for_bit(dtype: torch.dtype, device: torch.device) -> None:
    num_tokens, heads, head_dim, block_size, num_blocks = 37, 2, 64, 16, 6
    shape = (num_blocks, block_size, heads, head_dim)
    k_cache = torch.zeros(shape, dtype=FP8_E4M3, device=device)
    v_cache = torch.zeros(shape, dtype=FP8_E4M3, device=device)
    # values across many binades, some past the range (clamped), exact zeros
    k = (torch.randn(num_tokens, heads, head_dim) * torch.logspace(-4, 3, head_dim)).to(dtype)
    v = (torch.randn(num_tokens, heads, head_dim) * 5).to(dtype)
    k[0, 0, :4] = 0.0
    k[0, 1, :4] = -0.0
    k[1, 0, :8] = torch.tensor([-1e-6, -1e-4, -3e-4, 3e-4, -0.0006, 0.0006, -500.0, 500.0])
    k, v = k.to(device), v.to(device)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 5]] = -1
    slots = slots.to(device)
    ks, vs = _scale(0.37, device), _scale(0.011, device)
    kc, vc, kr, vr = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, kc, vc, slots, ks, vs)
    write_kv_cache_ref(k, v, kr, vr, slots, ks, vs)
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    flat = kr.view(-1, heads, head_dim)
    s0 = int(slots[0])
    assert torch.equal(flat[s0].view(torch.uint8), quantize_fp8_ref(k[0], ks).view(torch.uint8))


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, quantize_e4m3(x, tl.load(scale_ptr)), mask=mask)


def test_e4m3_rounding_in_fp32_matches_torch_on_the_edge_cases(device: torch.device) -> None:
    """The kernels' rounding (as fp32, before the exact fp32 -> fp8 store) against torch's
    clamp and ``.to(float8_e4m3fn)`` (round to nearest, ties to even): signed zeros and
    small negatives that round to -0, halfway cases, the subnormal steps, the clamp to
    +-448 (and +-inf), NaN kept NaN. Bit for bit, the sign of zero included."""
    step = 2.0**-9  # the subnormal step; 2**-6 the smallest normal
    edge = [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, step / 2, -step / 2, 1.5 * step,
            -2.5 * step, 2.0**-6, 2.0**-6 * 1.0625, -(2.0**-6) * 1.1875, 1.0625, -1.1875,
            17.0, 19.0, -21.0, 240.0, 416.0, 432.0, 440.0, 447.9, 448.0, 449.0, 464.0,
            -479.0, 480.0, 1e6, -1e30, float("inf"), -float("inf"), float("nan"),
            -float("nan")]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(4096, generator=gen) * torch.logspace(-5, 3, 4096)
    x = torch.cat([torch.tensor(edge), rand]).to(device)
    for scale in (1.0, 0.37):
        s = torch.tensor(scale, device=device)
        got = torch.empty_like(x)
        _quantize_kernel[(triton.cdiv(x.numel(), 512),)](x, got, s, x.numel(), BLOCK=512)
        want = quantize_fp8_ref(x, s).float()
        nan = want.isnan()
        assert int(nan.sum()) == 2 and torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.skipif(not on_native_gpu(), reason="the interpreter cannot store NaN as FP8")
def test_fp8_write_keeps_nan(device: torch.device) -> None:
    cache = torch.zeros(2, 16, 1, 64, dtype=FP8_E4M3, device=device)
    k = torch.randn(3, 1, 64, device=device)
    k[1, 0, 5] = float("nan")
    slots = torch.arange(3, device=device)
    one = torch.tensor(1.0, device=device)
    got, want = cache.clone(), cache.clone()
    write_kv_cache(k, k, got, cache.clone(), slots, one, one)
    write_kv_cache_ref(k, k, want, cache.clone(), slots, one, one)
    nan = want.float().isnan()
    assert int(nan.sum()) == 1 and torch.equal(got.float().isnan(), nan)
    assert torch.equal(got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


def test_an_fp8_cache_needs_its_scales(device: torch.device) -> None:
    cache = torch.zeros(2, 16, 1, 64, dtype=FP8_E4M3, device=device)
    k = torch.randn(3, 1, 64, device=device)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        write_kv_cache(k, k, cache, cache.clone(), torch.arange(3, device=device))


def _fp8_paged(seq_lens: list[int], heads: int, head_dim: int, block_size: int, device):
    kv = random_paged_kv(seq_lens, heads, head_dim, block_size, torch.float32, device)
    ks, vs = _scale(0.02, device), _scale(0.013, device)
    return kv, quantize_fp8_ref(kv.k_cache, ks), quantize_fp8_ref(kv.v_cache, vs), ks, vs


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_decode_matches_ref(dtype: torch.dtype, num_splits: int, device) -> None:
    seq_lens, kv_heads, group, head_dim, block_size = [1, 37, 100], 2, 4, 64, 16
    kv, kc, vc, ks, vs = _fp8_paged(seq_lens, kv_heads, head_dim, block_size, device)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    args = (q, kc, vc, kv.block_tables, kv.seq_lens, scale)
    got = paged_decode_attention(*args, num_splits=num_splits, k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_ref(*args, k_scale=ks, v_scale=vs)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, **tolerances(dtype))
    # the scales matter: the same blocks read as if unscaled give another answer
    plain = paged_decode_attention_ref(
        q.float(), kc.float(), vc.float(), kv.block_tables, kv.seq_lens, scale
    )
    assert rel_error(plain, ref.float()) > 0.5


@pytest.mark.skipif(not on_native_gpu(), reason="bf16 needs CUDA without the interpreter")
def test_fp8_decode_with_large_bf16_queries() -> None:
    """bf16 queries meet an FP8 cache as fp16 (scaled first): large ones give the
    reference's answer; ones past fp16's range even after scaling are clamped, never
    infinite."""
    device = torch.device("cuda")
    seq_lens, kv_heads, group, head_dim, block_size = [1, 37, 300], 2, 4, 128, 16
    kv, kc, vc, ks, vs = _fp8_paged(seq_lens, kv_heads, head_dim, block_size, device)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, device=device)
    scale = head_dim**-0.5
    for factor, exact in ((30.0, True), (3e6, False)):
        qb = (q * factor).to(torch.bfloat16)
        args = (qb, kc, vc, kv.block_tables, kv.seq_lens, scale)
        got = paged_decode_attention(*args, k_scale=ks, v_scale=vs)
        assert got.isfinite().all(), factor
        if exact:
            ref = paged_decode_attention_ref(*args, k_scale=ks, v_scale=vs)
            torch.testing.assert_close(got, ref, **tolerances(torch.bfloat16))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
def test_fp8_prefill_matches_ref(dtype: torch.dtype, device: torch.device) -> None:
    seq_lens, q_lens, kv_heads, group, head_dim, block_size = [40, 7, 64], [40, 1, 20], 2, 2, 64, 16
    kv, kc, vc, ks, vs = _fp8_paged(seq_lens, kv_heads, head_dim, block_size, device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, device=device).to(dtype)
    args = (q, kc, vc, starts.to(device), kv.seq_lens, kv.block_tables, max(q_lens))
    got = paged_prefill_attention(*args, head_dim**-0.5, k_scale=ks, v_scale=vs)
    ref = paged_prefill_attention_ref(*args, head_dim**-0.5, k_scale=ks, v_scale=vs)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, **tolerances(dtype))
