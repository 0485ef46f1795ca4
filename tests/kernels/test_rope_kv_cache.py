"""The fused rotary + KV-write kernel against the two kernels it replaces (bit for bit)
and against the torch references."""

from __future__ import annotations

import os

import pytest
import torch

from kvscale.kernels.fp8 import FP8_E4M3
from kvscale.kernels.kv_cache import write_kv_cache
from kvscale.kernels.rope_kv_cache import rope_and_write_kv, rope_and_write_kv_ref
from kvscale.kernels.rotary import compute_cos_sin_cache, rotary_embedding
from kvscale.kernels.testing import kernel_dtypes

MAX_POS, BLOCK, NUM_BLOCKS = 4096, 16, 6


def _case(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device
) -> dict:
    t = 13
    # q, k, v as strided views of a fused qkv projection output
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, dtype=dtype, device=device) * 3
    positions = torch.randint(0, MAX_POS, (t,))
    positions[[3, 7]] = torch.tensor([MAX_POS, -1])  # outside the cache: not rotated
    slots = torch.randperm(NUM_BLOCKS * BLOCK)[:t]
    slots[[2, 7, 12]] = -1  # padding: not written (7: neither rotated nor written)
    return {
        "positions": positions.to(device),
        "q": qkv[:, :heads],
        "k": qkv[:, heads : heads + kv_heads],
        "v": qkv[:, heads + kv_heads :],
        "cos_sin_cache": compute_cos_sin_cache(head_dim, MAX_POS, 10000.0).to(device),
        "slot_mapping": slots.to(device),
    }


def _caches(
    cache_dtype: torch.dtype, kv_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, kv_heads, head_dim)
    return (
        torch.randn(shape, device=device).to(cache_dtype),
        torch.randn(shape, device=device).to(cache_dtype),
    )


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["cache-as-model", "cache-fp8"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 64), (4, 4, 32), (8, 1, 128)])
def test_fused_matches_rotary_then_write_bit_for_bit(
    dtype: torch.dtype, fp8: bool, heads: int, kv_heads: int, head_dim: int, device
) -> None:
    c = _case(dtype, heads, kv_heads, head_dim, device)
    kc, vc = _caches(FP8_E4M3 if fp8 else dtype, kv_heads, head_dim, device)
    scales = {}
    if fp8:
        scales = {
            "k_scale": torch.tensor(0.05, device=device),
            "v_scale": torch.tensor(0.02, device=device),
        }
    before = {name: x.clone() for name, x in c.items()}

    fk, fv = kc.clone(), vc.clone()
    q_out = rope_and_write_kv(**c, k_cache=fk, v_cache=fv, **scales)
    for name, x in c.items():  # inputs unchanged
        assert torch.equal(x, before[name]), name

    q2, k2 = c["q"].clone(), c["k"].clone()
    rotary_embedding(c["positions"], q2, k2, c["cos_sin_cache"])
    uk, uv = kc.clone(), vc.clone()
    write_kv_cache(k2, c["v"], uk, uv, c["slot_mapping"], **scales)
    assert q_out.is_contiguous() and q_out.dtype == dtype
    assert torch.equal(q_out, q2)
    assert torch.equal(_bits(fk), _bits(uk)) and torch.equal(_bits(fv), _bits(uv))
    # the padding rows' slots kept their old contents; the token outside the cache kept q
    assert torch.equal(q_out[3], c["q"][3]) and torch.equal(q_out[7], c["q"][7])
    assert int((_bits(fk) != _bits(kc)).any(-1).any(-1).sum()) == 10  # 13 tokens, 3 padding


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
def test_fused_matches_the_torch_reference(dtype: torch.dtype, device: torch.device) -> None:
    c = _case(dtype, 6, 2, 64, device)
    c["positions"] = c["positions"].clamp(0, MAX_POS - 1)  # the reference indexes the cache
    kc, vc = _caches(dtype, 2, 64, device)
    fk, fv, rk, rv = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    q_out = rope_and_write_kv(**c, k_cache=fk, v_cache=fv)
    q_ref = rope_and_write_kv_ref(**c, k_cache=rk, v_cache=rv)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(q_out, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(fk, rk, atol=tol, rtol=tol)
    assert torch.equal(fv, rv)  # v is only copied
    # the rotation moved q (a kernel that copied q unrotated would fail here)
    assert not torch.allclose(q_out[0], c["q"][0], atol=tol, rtol=tol)


def test_bad_shapes_are_refused(device: torch.device) -> None:
    c = _case(torch.float32, 4, 2, 32, device)
    kc, vc = _caches(torch.float32, 2, 32, device)
    with pytest.raises(ValueError, match="positions must be"):
        rope_and_write_kv(**{**c, "positions": c["positions"][:3]}, k_cache=kc, v_cache=vc)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rope_and_write_kv(**{**c, "slot_mapping": c["slot_mapping"][:3]}, k_cache=kc, v_cache=vc)
    strided_q = torch.zeros(13, 4, 64, device=device)[..., ::2]  # [T, Hq, D], stride 2
    with pytest.raises(ValueError, match="q: the last dim must be contiguous"):
        rope_and_write_kv(**{**c, "q": strided_q}, k_cache=kc, v_cache=vc)
    fp8 = _caches(FP8_E4M3, 2, 32, device)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        rope_and_write_kv(**c, k_cache=fp8[0], v_cache=fp8[1])


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CPU engine; on a GPU tests/gpu/test_engine_cuda.py runs the engine on CUDA",
)
def test_an_engine_on_the_triton_backend_decodes_as_the_torch_backend(
    llama_ckpt, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused kernel in the engine (with the Triton attention, elementwise and argmax
    kernels under the interpreter), fp32, chunked prefill and preemption: the same greedy
    tokens as the torch backend, whose rotary and KV write are the two references; and
    with the decode kernel doing decode steps' rotary and KV write, before its loop and
    (``KVSCALE_ROPE_IN_LOOP``, every grid taken as small) in it."""
    from kvscale.kernels import paged_decode
    from kvscale.server import LLM, SamplingParams
    from tests.hf_reference import random_prompts

    prompts = random_prompts(4, (3, 30), seed=11)
    tight = dict(
        device="cpu", dtype="float32", num_kv_blocks=12, max_model_len=64, block_size=8,
        max_num_batched_tokens=16, max_num_seqs=4, enforce_eager=True,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs, stats = {}, {}
    # "triton-fused": decode-only steps rotate and write K/V in the decode kernel
    for name, backend, fused in (
        ("torch", "torch", "0"),
        ("triton", "triton", "0"),
        ("triton-fused", "triton", "1"),
        ("in-loop", "triton", "1"),
    ):
        if name == "in-loop":
            monkeypatch.setattr(paged_decode, "USE_ROPE_IN_LOOP", True)
            monkeypatch.setattr(paged_decode, "num_sms", lambda device: 10_000)
        os.environ["KVSCALE_FUSED_DECODE"] = fused
        try:
            llm = LLM(str(llama_ckpt), **tight, attention_backend=backend)
        finally:
            del os.environ["KVSCALE_FUSED_DECODE"]
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        stats[name] = llm.engine.stats()
    assert outs["triton"] == outs["torch"] == outs["triton-fused"] == outs["in-loop"]
    assert stats["triton"].num_preemptions > 0
    assert llm.engine.worker.backend.rope_in_decode
