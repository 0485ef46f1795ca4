"""The FP8 (E4M3) KV cache paths of the kernels against their torch references: the write
quantizes bit for bit as ``Tensor.to(float8_e4m3fn)`` does, and decode/prefill attention
read FP8 blocks with per-layer scales. Under the Triton interpreter the FP8 tiles are
read and upcast exactly as on the GPU (the write rounds in fp32 arithmetic, see
``kernels/fp8.py``); natively the same tests run in bf16 too."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.fp8 import FP8_E4M3, quantize_fp8_ref
from kvscale.kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from kvscale.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from kvscale.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref
from kvscale.kernels.testing import kernel_dtypes, random_paged_kv, rel_error, tolerances


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
