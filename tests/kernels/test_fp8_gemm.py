"""The block-scaled FP8 GEMM against its torch reference (dequantize, fp32 matmul), and
the reference against the definition, on odd shapes."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.fp8 import FP8_E4M3, quantize_groups, quantize_groups_ref
from kvscale.kernels.fp8_gemm import dequantize_blocks, w8a8_block_matmul, w8a8_block_matmul_ref
from kvscale.kernels.testing import kernel_dtypes, on_native_gpu, rel_error


def _weight(n: int, k: int, block: tuple[int, int], device: torch.device):
    """A random FP8 weight and block scales as a checkpoint would hold them."""
    w = torch.randn(n, k, device=device) * torch.logspace(-2, 1, k, device=device)
    gn, gk = block
    rows, cols = -(-n // gn), k // gk
    pad = torch.zeros(rows * gn, k, device=device)
    pad[:n] = w
    amax = pad.reshape(rows, gn, cols, gk).abs().amax(dim=(1, 3))
    scale = amax / 448
    q = (pad / scale.repeat_interleave(gn, 0).repeat_interleave(gk, 1))[:n]
    return q.clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _limit(out_dtype: torch.dtype) -> float:
    """The kernel's relative error bound against the fp32 reference. 16-bit outputs: their
    rounding. fp32 output: the interpreter sums the FP8 products in fp32, but Hopper's FP8
    tensor cores keep only about 14 bits while they accumulate one K group (DeepSeek-V3
    report, 3.3.2; Triton's default on sm_90 is max_num_imprecise_acc = 2**30, no
    promotion inside a dot) before the kernel adds the scaled group sum in fp32, as
    DeepGEMM does. On an H100: 5.7e-5 at M=33 (64-row tiles), under 1e-5 at M <= 16
    (16-row tiles); 2**-12 leaves 4x."""
    if out_dtype != torch.float32:
        return 1e-2
    return 2.0**-12 if on_native_gpu() else 1e-5


@pytest.mark.parametrize("out_dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 256, 256), (7, 200, 384), (33, 384, 128)])
def test_block_gemm_matches_ref(out_dtype: torch.dtype, m: int, n: int, k: int, device) -> None:
    block = (128, 128)
    x = torch.randn(m, k, device=device) * 3
    xq, xs = quantize_groups_ref(x, block[1])
    wq, ws = _weight(n, k, block, device)
    got = w8a8_block_matmul(xq, xs, wq, ws, block, out_dtype)
    ref = w8a8_block_matmul_ref(xq, xs, wq, ws, block, torch.float32)
    assert got.dtype == out_dtype and got.shape == (m, n)
    assert rel_error(got, ref) < _limit(out_dtype)
    # the reference is the definition: dequantized activations times dequantized weight
    exact = (xq.double() * xs.double().repeat_interleave(block[1], 1)) @ (
        dequantize_blocks(wq, ws, block).double().T
    )
    assert rel_error(ref, exact) < 1e-6
    # and close to the unquantized product: FP8 keeps ~3 significant bits per factor
    assert rel_error(ref, x @ dequantize_blocks(wq, ws, block).T) < 0.08


def test_group_quantization_round_trips_within_one_fp8_step(device: torch.device) -> None:
    x = torch.randn(5, 256, device=device) * torch.logspace(-3, 2, 256, device=device)
    q, s = quantize_groups_ref(x, 128)
    back = q.float() * s.repeat_interleave(128, 1)
    assert s.shape == (5, 2) and q.dtype == torch.float8_e4m3fn
    assert ((back - x).abs() <= x.abs() / 16 + s.repeat_interleave(128, 1) * 2**-9).all()


@pytest.mark.skipif(not on_native_gpu(), reason="needs CUDA without the interpreter")
def test_block_gemm_at_llama_shapes_bf16() -> None:
    block = (128, 128)
    for m in (1, 16, 300):
        x = torch.randn(m, 4096, device="cuda")
        xq, xs = quantize_groups_ref(x, 128)
        wq, ws = _weight(6144, 4096, block, torch.device("cuda"))
        got = w8a8_block_matmul(xq, xs, wq, ws, block, torch.bfloat16)
        ref = w8a8_block_matmul_ref(xq, xs, wq, ws, block, torch.float32)
        assert rel_error(got, ref) < 1e-2


@pytest.mark.parametrize("dtype", kernel_dtypes())
@pytest.mark.parametrize(
    ("m", "k", "group"),
    [(1, 320, 320), (5, 2304, 2304), (3, 512, 128), (2, 14336, 14336), (2, 16448, 16448)],
)
def test_quantize_groups_kernel_gives_the_reference_bits(
    dtype: torch.dtype, m: int, k: int, group: int, device: torch.device
) -> None:
    """One kernel per token (``group = K``, non-power-of-two K, the 8B model's widest
    input, a group past ``ONE_PASS_MAX``: read twice) or per group: the same FP8 bits and
    scales as the torch reference, zero rows included."""
    x = (torch.randn(m, k, device=device) * torch.logspace(-3, 2, k, device=device)).to(dtype)
    x[0, :group] = 0  # an all-zero group: the scale floor
    q, s = quantize_groups(x, group)
    q_ref, s_ref = quantize_groups_ref(x, group)
    assert q.dtype == FP8_E4M3 and s.shape == (m, k // group)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
