"""Paged decode attention doing a decode step's rotary embedding and KV write itself
(``rope=RopeWrite(...)``) against the two kernels it replaces, rope_kv_cache's then plain
paged decode: the same cache bit for bit, and the same output (bit for bit under the
interpreter where the kernel rotates before its loop; within rounding where it rotates in
it)."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels import paged_decode
from kvscale.kernels.fp8 import FP8_E4M3
from kvscale.kernels.paged_decode import RopeWrite, paged_decode_attention
from kvscale.kernels.rope_kv_cache import rope_and_write_kv
from kvscale.kernels.rotary import compute_cos_sin_cache
from kvscale.kernels.testing import kernel_dtypes, on_native_gpu, random_paged_kv, tolerances

MAX_POS = 512
# the newest token's slot is each row's last; row 3's position is past the rotary table
# (not rotated), row 4 is padding (slot -1: nothing written, as a graph's padding rows)
SEQ_LENS = [1, 37, 100, 64, 5]


def _case(
    dtype: torch.dtype,
    kv_heads: int,
    group: int,
    head_dim: int,
    block: int,
    fp8: bool,
    device: torch.device,
) -> dict:
    kv = random_paged_kv(SEQ_LENS, kv_heads, head_dim, block, dtype, device)
    k_cache, v_cache = kv.k_cache, kv.v_cache
    scales: dict[str, torch.Tensor | None] = {"k_scale": None, "v_scale": None}
    if fp8:
        k_cache, v_cache = k_cache.to(FP8_E4M3), v_cache.to(FP8_E4M3)
        scales = {
            "k_scale": torch.tensor(0.75, device=device),
            "v_scale": torch.tensor(1.5, device=device),
        }
    heads = kv_heads * group
    b = len(SEQ_LENS)
    qkv = torch.randn(b, heads + 2 * kv_heads, head_dim, dtype=dtype, device=device) * 2
    last = torch.tensor(SEQ_LENS) - 1
    table = kv.block_tables.cpu().long()
    slots = table[torch.arange(b), last // block] * block + last % block
    slots[4] = -1
    positions = last.clone()
    positions[3] = MAX_POS
    return {
        "q": qkv[:, :heads],
        "rope": RopeWrite(
            positions.to(device),
            qkv[:, heads : heads + kv_heads],
            qkv[:, heads + kv_heads :],
            compute_cos_sin_cache(head_dim, MAX_POS, 10000.0).to(device),
            slots.to(device),
        ),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": kv.block_tables,
        "seq_lens": kv.seq_lens,
        "scales": scales,
    }


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_same_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal (the unused slots hold NaN garbage), except an fp32 cache on a GPU: there
    the compiler may contract the rotation's multiply-adds into FMAs differently in the two
    kernels (a last-bit difference that rounding to 16 or 8 bits hides)."""
    if got.dtype == torch.float32 and on_native_gpu():
        torch.testing.assert_close(got, want, equal_nan=True, **tolerances(torch.float32))
    else:
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["cache-as-model", "cache-fp8"])
@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(2, 4, 64), (1, 1, 128)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("in_loop", [False, True], ids=["before-loop", "in-loop"])
def test_rope_in_decode_equals_rope_kernel_then_decode(
    dtype: torch.dtype,
    fp8: bool,
    kv_heads: int,
    group: int,
    head_dim: int,
    num_splits: int | None,
    in_loop: bool,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both ways the kernel does the RoPE + KV write: before its loop (the default; grids
    larger than the GPU's SMs) and in it (``KVSCALE_ROPE_IN_LOOP=1``, at most one program
    an SM: here by the SM count it sees)."""
    if in_loop:
        monkeypatch.setattr(paged_decode, "USE_ROPE_IN_LOOP", True)
        monkeypatch.setattr(paged_decode, "num_sms", lambda device: 10_000)
    c = _case(dtype, kv_heads, group, head_dim, 16, fp8, device)
    r, scale = c["rope"], head_dim**-0.5
    two = {n: c[n].clone() for n in ("k_cache", "v_cache")}
    q_rot = rope_and_write_kv(
        r.positions,
        c["q"],
        r.k,
        r.v,
        r.cos_sin_cache,
        two["k_cache"],
        two["v_cache"],
        r.slot_mapping,
        **c["scales"],
    )
    want = paged_decode_attention(
        q_rot,
        two["k_cache"],
        two["v_cache"],
        c["tables"],
        c["seq_lens"],
        scale,
        num_splits=num_splits,
        max_seq_len=700,
        **c["scales"],
    )
    one = {n: c[n].clone() for n in ("k_cache", "v_cache")}
    got = paged_decode_attention(
        c["q"],
        one["k_cache"],
        one["v_cache"],
        c["tables"],
        c["seq_lens"],
        scale,
        num_splits=num_splits,
        max_seq_len=700,
        rope=r,
        **c["scales"],
    )
    for n in ("k_cache", "v_cache"):
        _assert_same_cache(one[n], two[n])
    assert not got.isnan().any()
    if in_loop or on_native_gpu():
        # in the loop the newest token's term is added after it, from registers (another
        # order of summation); natively the compiler may contract the rotation otherwise
        torch.testing.assert_close(got, want, **tolerances(dtype))
    else:
        assert torch.equal(got, want)


def test_a_bad_rope_is_refused(device: torch.device) -> None:
    c = _case(torch.float32, 2, 4, 64, 16, False, device)
    r = c["rope"]._replace(positions=c["rope"].positions[:2])
    with pytest.raises(ValueError, match="positions"):
        paged_decode_attention(
            c["q"], c["k_cache"], c["v_cache"], c["tables"], c["seq_lens"], 0.125, rope=r
        )


@pytest.mark.parametrize("fused", [True, False])
def test_the_triton_backend_fuses_decode_only_steps(
    fused: bool, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode-only steps go through the decode kernel alone (the rotary + KV write kernel
    is not called) unless ``KVSCALE_FUSED_DECODE=0``; either way the same output."""
    from kvscale.server.attention import triton_backend
    from kvscale.server.attention.metadata import AttentionMetadata
    from kvscale.server.worker.kv_pool import LayerKV

    monkeypatch.setenv("KVSCALE_FUSED_DECODE", "1" if fused else "0")
    backend = triton_backend.TritonAttentionBackend()
    c = _case(torch.float32, 2, 4, 64, 16, False, device)
    r = c["rope"]
    b = len(SEQ_LENS)
    meta = AttentionMetadata(
        slot_mapping=r.slot_mapping,
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
        seq_lens=c["seq_lens"],
        block_tables=c["tables"],
        max_query_len=1,
        max_seq_len=700,
    )
    unit = torch.ones((), device=device)
    two = LayerKV(c["k_cache"].clone(), c["v_cache"].clone(), unit, unit)
    want = triton_backend.AttentionBackend.rope_write_and_attend(
        backend, c["q"], r.k, r.v, r.positions, r.cos_sin_cache, two, meta, 0.125
    )
    calls = []
    real = triton_backend.rope_and_write_kv
    monkeypatch.setattr(
        triton_backend, "rope_and_write_kv", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    one = LayerKV(c["k_cache"].clone(), c["v_cache"].clone(), unit, unit)
    got = backend.rope_write_and_attend(
        c["q"], r.k, r.v, r.positions, r.cos_sin_cache, one, meta, 0.125
    )
    assert len(calls) == (0 if fused else 1)
    _assert_same_cache(one.k, two.k)
    _assert_same_cache(one.v, two.v)
    torch.testing.assert_close(got, want, **tolerances(torch.float32))
