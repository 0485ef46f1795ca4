from __future__ import annotations

import pytest
import torch

from kvscale.kernels.activation import silu_and_mul, silu_and_mul_ref
from kvscale.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from kvscale.kernels.rotary import compute_cos_sin_cache, rotary_embedding, rotary_embedding_ref
from kvscale.kernels.testing import kernel_dtypes, tolerances

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _tight(dtype: torch.dtype) -> dict[str, float]:
    # Same fp32 math as the reference; allow one rounding step of the output dtype.
    return {
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.float16: {"atol": 1e-3, "rtol": 1e-3},
        torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
    }[dtype]


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
def test_rms_norm(dtype: torch.dtype, hidden: int, device: torch.device) -> None:
    big = torch.randn(5, hidden + 8, dtype=dtype, device=device)
    x = big[:, :hidden]  # strided rows
    weight = torch.randn(hidden, dtype=dtype, device=device)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **_tight(dtype)
    )


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("hidden", [64, 1000])
def test_fused_add_rms_norm(dtype: torch.dtype, hidden: int, device: torch.device) -> None:
    x = torch.randn(6, hidden, dtype=dtype, device=device)
    res = torch.randn(6, hidden, dtype=dtype, device=device)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    x_k, r_k, x_r, r_r = x.clone(), res.clone(), x.clone(), res.clone()
    fused_add_rms_norm(x_k, r_k, weight, 1e-6)
    fused_add_rms_norm_ref(x_r, r_r, weight, 1e-6)
    torch.testing.assert_close(r_k, r_r, atol=0, rtol=0)
    torch.testing.assert_close(x_k, x_r, **_tight(dtype))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rotary_embedding(
    dtype: torch.dtype, head_dim: int, scaling: dict | None, device: torch.device
) -> None:
    num_tokens, num_heads, num_kv_heads, max_pos = 7, 8, 2, 20000
    cache = compute_cos_sin_cache(head_dim, max_pos, 500000.0, scaling).to(device)
    positions = torch.randint(0, max_pos, (num_tokens,), device=device)
    qkv = torch.randn(
        num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device
    )
    ref = qkv.clone()
    rotary_embedding(positions, qkv[:, :num_heads], qkv[:, num_heads : num_heads + 2], cache)
    rotary_embedding_ref(positions, ref[:, :num_heads], ref[:, num_heads : num_heads + 2], cache)
    torch.testing.assert_close(qkv, ref, **_tight(dtype))


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3],
    ids=["default", "linear", "llama3"],
)
def test_cos_sin_cache_matches_transformers(scaling: dict | None) -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    head_dim, max_pos, theta = 128, 4096, 500000.0
    params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    config = llama.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    rope = llama.LlamaRotaryEmbedding(config=config)
    positions = torch.arange(max_pos)[None]
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    ours = compute_cos_sin_cache(head_dim, max_pos, theta, scaling)
    half = head_dim // 2
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half], atol=0, rtol=0)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("inter", [100, 2500])
def test_silu_and_mul(dtype: torch.dtype, inter: int, device: torch.device) -> None:
    x = torch.randn(5, 2 * inter, dtype=dtype, device=device) * 3
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **_tight(dtype))
    y = torch.randn(2, 3, 2 * inter, dtype=dtype, device=device)
    assert silu_and_mul(y).shape == (2, 3, inter)
    torch.testing.assert_close(silu_and_mul(y), silu_and_mul_ref(y), **_tight(dtype))


def test_tolerances_admit_rounding_and_reject_real_errors() -> None:
    """Each dtype's tolerance passes the dtype's own rounding of fp32 values and fails a
    10% error in one element: the kernel comparisons can fail."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    for dtype in (*kernel_dtypes(), torch.float32, torch.float16, torch.bfloat16):
        tol = tolerances(dtype)
        torch.testing.assert_close(x.to(dtype).float(), x, **tol)
        wrong = x.clone()
        wrong[7] += 0.1 + 0.1 * x[7].abs()
        with pytest.raises(AssertionError):
            torch.testing.assert_close(wrong, x, **tol)
