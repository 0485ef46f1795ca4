from __future__ import annotations

import pytest
import torch

from kvscale.kernels import paged_decode
from kvscale.kernels.paged_decode import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kvscale.kernels.testing import (
    kernel_dtypes,
    on_native_gpu,
    random_paged_kv,
    tolerances,
)

gpu_only = pytest.mark.skipif(not on_native_gpu(), reason="needs CUDA without the interpreter")

SEQ_LENS = [1, 37, 100, 64]  # a 1-token context, lengths off and on block multiples


def _run(
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_splits: int | None,
    max_seq_len: int | None = None,
) -> None:
    kv = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    num_heads = num_kv_heads * group
    # q as a strided view of a fused qkv output.
    qkv = torch.randn(len(seq_lens), num_heads + 2, head_dim, dtype=dtype, device=device)
    q = qkv[:, :num_heads]
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    got = paged_decode_attention(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_tables,
        kv.seq_lens,
        scale,
        out=out,
        num_splits=num_splits,
        max_seq_len=max_seq_len,
    )
    assert got is out
    ref = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_ref(
    dtype: torch.dtype,
    group: int,
    head_dim: int,
    block_size: int,
    num_splits: int,
    device: torch.device,
) -> None:
    _run(SEQ_LENS, 2, group, head_dim, block_size, dtype, device, num_splits)


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
def test_decode_automatic_splits(dtype: torch.dtype, device: torch.device) -> None:
    seq_lens = [700, 5]
    sms = paged_decode.num_sms(device)
    assert choose_num_splits(2, 1, 700, sms) > 1  # the automatic choice splits here
    _run(seq_lens, 1, 4, 64, 16, dtype, device, None, max_seq_len=700)
    _run(seq_lens, 1, 4, 64, 16, dtype, device, None)  # bound from the block table
    _run([33], 1, 4, 64, 16, dtype, device, None)  # short: no split


def test_decode_more_splits_than_blocks(device: torch.device) -> None:
    _run([1, 20, 50], 2, 4, 64, 16, torch.float32, device, 8)


def test_decode_odd_group_and_head_sizes(device: torch.device) -> None:
    _run([9, 40], 2, 3, 32, 8, torch.float32, device, 1)
    _run([9, 40], 1, 2, 256, 16, torch.float16, device, 2)


def test_decode_empty_sequence_gives_zeros(device: torch.device) -> None:
    for splits in (1, 2):
        kv = random_paged_kv([0, 20], 1, 64, 16, torch.float32, device)
        q = torch.randn(2, 4, 64, device=device)
        out = paged_decode_attention(
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125, num_splits=splits
        )
        ref = paged_decode_attention_ref(
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125
        )
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out, ref, **tolerances(torch.float32))


def test_choose_num_splits() -> None:
    assert choose_num_splits(64, 8, 4096, 132) == 1  # 512 programs fill 132 SMs
    assert choose_num_splits(1, 8, 128, 132) == 1  # short context
    n = choose_num_splits(1, 8, 32768, 132)
    assert 16 <= n <= paged_decode.MAX_SPLITS
    assert n * 8 >= 132  # enough programs for every SM
    assert choose_num_splits(1, 8, 1024, 132) <= 1024 // paged_decode.MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(4, 8, 32768, 132) <= n
    assert choose_num_splits(0, 8, 32768, 132) >= 1


def test_decode_config_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # as on CUDA: an FP8 cache without splits takes e85's 2 warps and 4 stages, the rest
    # (bf16, or split grids such as batch-1 decode) the tuned 4 warps and 3 stages
    monkeypatch.setattr(paged_decode, "is_interpreter", lambda: False)
    cfg = paged_decode.decode_config
    assert cfg(128, 16) == {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    assert cfg(128, 16, kv_fp8=True) == {"BLOCK_N": 64, "num_warps": 2, "num_stages": 4}
    assert cfg(128, 16, kv_fp8=True, split=True) == cfg(128, 16)
    assert cfg(128, 16, split=True) == cfg(128, 16)
    assert cfg(256, 16)["BLOCK_N"] == 32 and cfg(128, 128)["BLOCK_N"] == 128


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_splits", [1, None, 7])
def test_decode_long_context_gpu(
    dtype: torch.dtype, num_splits: int | None, device: torch.device
) -> None:
    _run([4096, 1, 3000, 777], 8, 4, 128, 16, dtype, device, num_splits)
    _run([2500, 17], 4, 8, 256, 32, dtype, device, num_splits)
