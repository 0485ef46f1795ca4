from __future__ import annotations

import pytest
import torch

from kvscale.kernels.paged_prefill import (
    SHORT_QUERY,
    _launches,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from kvscale.kernels.testing import kernel_dtypes, on_native_gpu, random_paged_kv, tolerances

gpu_only = pytest.mark.skipif(not on_native_gpu(), reason="needs CUDA without the interpreter")

# (earlier context, query length) per sequence: fresh prefill, chunked prefill with cached
# context, decode rows (one with a 1-token context), a short chunk after a long context.
MIXED = [(0, 20), (33, 17), (40, 1), (0, 1), (60, 5)]


def _run(
    chunks: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    extra_max_len: int = 0,
    short_query: int = SHORT_QUERY,
) -> None:
    seq_lens = [ctx + q_len for ctx, q_len in chunks]
    q_lens = [q_len for _, q_len in chunks]
    kv = random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    num_heads = num_kv_heads * group
    qkv = torch.randn(starts[-1], num_heads + 2, head_dim, dtype=dtype, device=device)
    q = qkv[:, :num_heads]
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    args = (q, kv.k_cache, kv.v_cache, query_start_loc, kv.seq_lens, kv.block_tables)
    got = paged_prefill_attention(
        *args, max(q_lens) + extra_max_len, scale, out=out, short_query=short_query
    )
    assert got is out
    ref = paged_prefill_attention_ref(*args, max(q_lens), scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **tolerances(dtype))


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_ref(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, device: torch.device
) -> None:
    _run(MIXED, 2, group, head_dim, block_size, dtype, device)


# MIXED's query lengths are 20, 17, 1, 1, 5: short_query 4 splits them 3 long / 2 short,
# 16 (the default) 2 / 3, 32 puts all in the small tiles, 0 all in the large ones
@pytest.mark.parametrize("short_query", [0, 1, 4, 17, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_short_and_long_sequences_in_their_own_tiles(
    short_query: int, group: int, device: torch.device
) -> None:
    _run(MIXED, 2, group, 64, 16, torch.float32, device, short_query=short_query)


def test_each_batch_gets_the_launches_it_needs() -> None:
    def launches(num_tokens: int, batch: int, max_q: int, short: int = 16) -> list[tuple]:
        return [(c["BLOCK_M"], lo, hi) for c, lo, hi in _launches(num_tokens, batch, max_q,
                                                                  short, 128, 4, 2)]  # fmt: skip

    big, small, no_limit = launches(8192, 16, 512)[0][0], launches(64, 64, 1)[0][0], 2**31 - 1
    assert small == 16 and big > small
    assert launches(64, 64, 1) == [(small, 0, no_limit)]  # decode rows only
    assert launches(80, 16, 5) == [(small, 0, no_limit)]  # verify rows of 1 + 4 tokens
    assert launches(8192, 16, 512) == [(big, 0, no_limit)]  # equal prompts: all long
    assert launches(554, 65, 490) == [(big, 17, no_limit), (small, 0, 16)]  # mixed
    assert launches(554, 65, 490, short=0) == [(big, 0, no_limit)]


def test_prefill_decode_only_rows(device: torch.device) -> None:
    _run([(0, 1), (36, 1), (15, 1)], 2, 4, 64, 16, torch.float32, device)


def test_prefill_many_sequences(device: torch.device) -> None:
    # Query offsets that straddle tile boundaries: each program must find its sequence.
    chunks = [(0, 3), (7, 1), (0, 9), (2, 1), (30, 14), (0, 1), (5, 2), (11, 1), (0, 6)]
    _run(chunks, 1, 4, 64, 16, torch.float16, device)
    _run(chunks, 2, 1, 64, 32, torch.float32, device)


def test_prefill_max_query_len_larger_than_needed(device: torch.device) -> None:
    _run([(5, 9), (0, 3)], 1, 4, 64, 16, torch.float16, device, extra_max_len=40)


def test_prefill_odd_group_and_head_sizes(device: torch.device) -> None:
    _run([(3, 10), (0, 7)], 2, 3, 32, 8, torch.float32, device)
    _run([(20, 6), (0, 11)], 1, 2, 256, 16, torch.float16, device)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4, 7])
def test_prefill_long_gpu(dtype: torch.dtype, group: int, device: torch.device) -> None:
    chunks = [(0, 1000), (512, 300), (2000, 1), (0, 1), (77, 129)]
    _run(chunks, 4, group, 128, 16, dtype, device)
    _run([(100, 400), (0, 257)], 2, group, 256, 32, dtype, device)
