from __future__ import annotations

import pytest
import torch

from kvscale.kernels.activation import (
    silu_and_mul,
    silu_and_mul_quant,
    silu_and_mul_quant_ref,
    silu_and_mul_ref,
)
from kvscale.kernels.fp8 import quantize_groups
from kvscale.kernels.rmsnorm import (
    fp8_group_fusable,
    fused_add_rms_norm,
    fused_add_rms_norm_quant,
    fused_add_rms_norm_quant_ref,
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


def _same_fp8(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    """Codes and scales of two FP8 quantizations: the same scales (to an fp32 rounding) and
    codes, but for a few one E4M3 step apart (or a few subnormal steps near 0) where the
    16-bit value before quantization was rounded the other way (the kernels' rsqrt and
    exp differ from torch's by an ulp)."""
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == q_ref.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    assert (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean() > 0.99
    step = s_ref.repeat_interleave(q.shape[-1] // s.shape[-1], dim=-1)
    deq, deq_ref = q.float() * step, q_ref.float() * step
    assert ((deq - deq_ref).abs() <= deq_ref.abs() * 2**-3 + step * 2**-7).all()


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize(("hidden", "group"), [(1000, 1000), (512, 512), (512, 128), (384, 128)])
def test_fused_add_rms_norm_quant(
    dtype: torch.dtype, hidden: int, group: int, device: torch.device
) -> None:
    """The norm quantized to FP8 in the norm's kernel: the residual as the unfused
    kernel leaves it (exactly), the FP8 codes and scales of the norm then
    ``quantize_groups`` (per token, or power-of-two groups, one row past the others'
    scale included), and ``x`` not written."""
    x = torch.randn(6, hidden, dtype=dtype, device=device)
    x[3] *= 50.0  # a row with another scale
    res = torch.randn(6, hidden, dtype=dtype, device=device)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    x_k, r_k, x_r, r_r = x.clone(), res.clone(), x.clone(), res.clone()
    got = fused_add_rms_norm_quant(x_k, r_k, weight, 1e-6, group)
    want = fused_add_rms_norm_quant_ref(x_r, r_r, weight, 1e-6, group)
    torch.testing.assert_close(r_k, r_r, atol=0, rtol=0)
    torch.testing.assert_close(x_k, x, atol=0, rtol=0)
    assert got[1].shape == (6, hidden // group)
    _same_fp8(got, want)
    x_u, r_u = x.clone(), res.clone()  # against the two kernels it replaces
    fused_add_rms_norm(x_u, r_u, weight, 1e-6)
    _same_fp8(got, quantize_groups(x_u, group))
    assert not fp8_group_fusable(384, 96) and fp8_group_fusable(384, 384)
    with pytest.raises(ValueError, match="do not tile"):
        fused_add_rms_norm_quant(x_k, r_k, weight, 1e-6, 3)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize(("inter", "group"), [(1000, 1000), (512, 128), (17, 17)])
def test_silu_and_mul_quant(dtype: torch.dtype, inter: int, group: int, device: torch.device):
    """SiLU-and-mul quantized to FP8 in its kernel: exactly the codes and scales of the
    two kernels it replaces (``silu_and_mul``, then ``quantize_groups``), and those of
    the torch reference up to the reference's own rounding of SiLU."""
    x = torch.randn(5, 2 * inter, dtype=dtype, device=device) * 4
    x[2] *= 8.0  # another scale (fp16 stays finite)
    q, s = silu_and_mul_quant(x, group)
    assert s.shape == (5, inter // group)
    q_two, s_two = quantize_groups(silu_and_mul(x), group)
    torch.testing.assert_close(s, s_two, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_two.view(torch.uint8))
    _same_fp8((q, s), silu_and_mul_quant_ref(x, group))
    with pytest.raises(ValueError, match="do not tile"):
        silu_and_mul_quant(x, inter + 1)
