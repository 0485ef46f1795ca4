from __future__ import annotations

import pytest
import torch

from kvscale.kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from kvscale.kernels.testing import kernel_dtypes


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_matches_ref(
    dtype: torch.dtype, head_dim: int, block_size: int, device: torch.device
) -> None:
    num_tokens, num_kv_heads, num_blocks = 11, 2, 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    # k, v as strided views of a fused qkv projection output.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, dtype=dtype, device=device)
    k, v = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[1, 4, 10]] = torch.tensor([-1, -7, -1])  # padding: not written
    slots = slots.to(device=device, dtype=torch.int64)

    kc, vc = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, kc, vc, slots)
    kr, vr = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    # Skipped tokens changed nothing; written ones landed in their slots.
    written = (kc != k_cache).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert sorted(written) == sorted(s for s in slots.tolist() if s >= 0)
    flat = kc.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat[slots[0]], k[0])


def test_write_kv_cache_casts_to_cache_dtype(device: torch.device) -> None:
    k_cache = torch.randn(2, 16, 1, 64, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(3, 1, 64, dtype=torch.float32, device=device)
    v = torch.randn_like(k)
    slots = torch.tensor([0, 17, -1], device=device)
    kc, vc, kr, vr = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, kc, vc, slots)
    write_kv_cache_ref(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
