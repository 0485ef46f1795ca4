"""The one-shot all-reduce kernel, its ranks as real concurrent processes.

On the CPU (Triton interpreter) each rank is a process and the "symmetric buffer" is
shared memory that every process addresses at its own virtual addresses, which is what
peer-mapped GPU memory gives each rank; the interpreter's atomics are real atomics, so
the flag exchange is the kernel's own. On a GPU machine each rank takes its own GPU
(peer access) when there are enough, else the test is skipped there (the multi-GPU
engine tests cover it).

Checked: every rank's x equals the rank-order fp32 sum rounded to the dtype (bit for
bit, and identical over ranks), the fused residual add + RMSNorm gives the bits of the
unfused path (that sum, then the ``fused_add_rms_norm`` kernel), launches of different
row counts in sequence reuse both slots, and afterwards each row's counter holds its
launches and every peer's flag for the row that count (its last epoch). A launch count
about to wrap (int32) starts the counters of one run: the slots and epochs wrap with it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import kvscale.kernels.one_shot_all_reduce as osar
from kvscale.kernels.one_shot_all_reduce import (
    all_reduce_add_rms_norm_ref,
    buffer_bytes,
    ll_offset,
    one_shot_all_reduce,
    signal_offset,
)
from kvscale.kernels.rmsnorm import fused_add_rms_norm
from kvscale.kernels.testing import on_native_gpu, tolerances
from tests.spawned_ranks import run_ranks

HIDDEN = 100  # not a power of two: masked lanes
MAX_ROWS = 6
LAUNCHES = [(1, False), (3, True), (1, True), (5, False), (3, True), (6, True)]  # (rows, norm)
EPS = 1e-5


def _inputs(world: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every launch's inputs of every rank (same seed in every process)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for rows, norm in LAUNCHES:
        parts = [torch.randn(rows, HIDDEN, generator=g).to(dtype) for _ in range(world)]
        residual = torch.randn(rows, HIDDEN, generator=g).to(dtype) if norm else None
        weight = torch.randn(HIDDEN, generator=g).to(dtype) if norm else None
        out.append({"parts": parts, "residual": residual, "weight": weight})
    return out


def _rank(
    rank: int,
    world: int,
    dtype: torch.dtype,
    start: int,
    ll_max: int,
    lag_s: float,
    buffers: list[torch.Tensor],
    q: Any,
) -> None:
    """One rank: every launch of ``LAUNCHES`` in order (every row's launch count starting
    at ``start``; sums of up to ``ll_max`` rows as flagged words; the last rank ``lag_s``
    late to each), then its flags, words and counters."""
    try:
        osar.LL_MAX_ROWS = ll_max or osar.LL_MAX_ROWS  # this rank process's own module
        device = torch.device("cpu")
        offset = signal_offset(MAX_ROWS, HIDDEN, dtype, world)
        data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        uses = torch.full((MAX_ROWS,), start, dtype=torch.int32, device=device)
        results = []
        for launch in _inputs(world, dtype):
            if rank == world - 1:
                time.sleep(lag_s)
            x = launch["parts"][rank].clone()
            residual = launch["residual"]
            residual = residual.clone() if residual is not None else None
            one_shot_all_reduce(
                x, data_ptrs, data_ptrs + offset, uses, rank, MAX_ROWS, residual,
                launch["weight"], EPS, ll=ll_max > 0,
            )  # fmt: skip
            results.append((x.numpy(), residual.numpy() if residual is not None else None))
        at = ll_offset(MAX_ROWS, HIDDEN, dtype, world)
        signals = buffers[rank][offset:at].view(torch.int32).numpy().copy()
        words = buffers[rank][at:].view(torch.int64).numpy().copy()
        q.put((rank, (results, signals, words, uses.numpy())))
    except BaseException as e:  # the parent reports it
        q.put((rank, f"{type(e).__name__}: {e}"))


# the most rows a sum may have to move as flagged words: none, every launch's, some
PROTOCOLS = pytest.mark.parametrize("ll_max", [0, MAX_ROWS, 3], ids=["flags", "words", "mixed"])


@pytest.mark.skipif(on_native_gpu(), reason="CPU ranks (interpreter); GPUs: tests/gpu")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@PROTOCOLS
def test_ranks_get_the_same_exact_sum_and_norm(world: int, dtype: torch.dtype, ll_max: int) -> None:
    _check_ranks(world, dtype, start=0, ll_max=ll_max)


@pytest.mark.skipif(on_native_gpu(), reason="CPU ranks (interpreter); GPUs: tests/gpu")
@PROTOCOLS
def test_launch_counts_may_wrap(ll_max: int) -> None:
    """Counters 3 launches short of int32's end: rows 0-2 cross it (slot and epoch wrap
    on every rank alike) and still sum exactly. The last rank comes late to every launch,
    so rank 0 is always the one waiting (mixed: on flags that launches moved as flagged
    words left behind, the first one still the 0 it started at)."""
    _check_ranks(2, torch.float32, start=2**31 - 3, ll_max=ll_max, lag_s=0.3)


def _int32(n: int) -> int:
    return (n + 2**31) % 2**32 - 2**31


def _check_ranks(
    world: int, dtype: torch.dtype, start: int, ll_max: int, lag_s: float = 0.0
) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # travels to the ranks in the environment
    nbytes = buffer_bytes(MAX_ROWS, HIDDEN, dtype, world)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8).share_memory_() for _ in range(world)]
    got = run_ranks(_rank, world, (world, dtype, start, ll_max, lag_s, buffers), timeout_s=300)
    for rank, result in got.items():
        assert not isinstance(result, str), f"rank {rank}: {result}"
    for i, launch in enumerate(_inputs(world, dtype)):
        residual = launch["residual"]
        want_res = residual.clone() if residual is not None else None
        want = all_reduce_add_rms_norm_ref(launch["parts"])  # the sum
        if want_res is not None:  # the unfused path: the sum, then the fused add + norm kernel
            ref_res = want_res.clone()
            close = all_reduce_add_rms_norm_ref(launch["parts"], ref_res, launch["weight"], EPS)
            fused_add_rms_norm(want, want_res, launch["weight"], EPS)
            torch.testing.assert_close(want, close, **tolerances(dtype))
        for rank in range(world):
            x, res = got[rank][0][i]
            assert torch.equal(torch.from_numpy(x), want), f"launch {i}, rank {rank}"
            if want_res is not None:
                assert torch.equal(torch.from_numpy(res), want_res), f"launch {i}, rank {rank}"
    # each row's launch count (its last epoch), and the last epoch it sent each way
    ll_rows = min(MAX_ROWS, ll_max)
    count, by_flag, by_words = [start] * MAX_ROWS, [0] * MAX_ROWS, [None] * MAX_ROWS
    for rows, _ in LAUNCHES:
        for r in range(rows):
            count[r] = _int32(count[r] + 1)
            if rows <= ll_rows:
                by_words[r] = count[r]
            else:
                by_flag[r] = count[r]
    for rank in range(world):
        _, signals, words, uses = got[rank]
        want_signals = torch.tensor(by_flag, dtype=torch.int32)[:, None].repeat(1, world)
        want_signals[:, rank] = 0  # a rank sends itself nothing
        assert torch.equal(torch.from_numpy(signals[: MAX_ROWS * world]).view(MAX_ROWS, world),
                           want_signals), f"rank {rank}"  # fmt: skip
        # the flagged words of each row's last such launch carry its epoch
        layout = min(MAX_ROWS, ll_max or osar.LL_MAX_ROWS)  # the region's rows
        n = 2 * layout * world * (HIDDEN * dtype.itemsize // 4)
        words = torch.from_numpy(words[:n]).view(2, layout, world, -1)  # [slot, row, from, -]
        assert not words[:, :, rank].any()
        assert ll_max or not words.any()
        for r in range(ll_rows):
            epochs = (words[(by_words[r] - 1) & 1, r] >> 32).to(torch.int32)
            want = torch.full((world,), by_words[r], dtype=torch.int32)
            want[rank] = 0
            assert torch.equal(epochs, want[:, None].expand_as(epochs)), f"rank {rank}, row {r}"
        assert torch.equal(torch.from_numpy(uses), torch.tensor(count, dtype=torch.int32))


def test_sums_must_fit_the_buffer() -> None:
    x = torch.zeros(MAX_ROWS + 1, HIDDEN)
    ptrs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 6"):
        one_shot_all_reduce(x, ptrs, ptrs, torch.zeros(MAX_ROWS, dtype=torch.int32), 0, MAX_ROWS)
