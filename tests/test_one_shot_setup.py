"""The one-shot all-reduce's set-up and dispatch on the CPU (the kernel itself:
``tests/kernels/test_one_shot_all_reduce.py``; on GPUs: ``tests/gpu/test_one_shot_cuda.py``).

- ``setup_one_shot`` on two gloo ranks: every rank gets None (not a GPU), after a vote
  that does not hang; ``ParallelState`` then sums over gloo and normalizes with the bits
  of the unfused path.
- ``OneShotAllReduce.fits``: only ``[T <= max_rows, hidden]`` in its dtype and device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ports import free_port
from tests.sm90 import compile_one_shot_sm90
from tests.spawned_ranks import run_ranks

HIDDEN = 64


def _rank(rank: int, port: int, q: Any) -> None:
    try:
        import torch.distributed as dist

        from kvscale.kernels.rmsnorm import fused_add_rms_norm_ref
        from kvscale.server.distributed.one_shot import setup_one_shot
        from kvscale.server.parallel import ParallelState

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        comm = setup_one_shot(None, rank, 2, torch.device("cpu"), HIDDEN, torch.float32)
        g = torch.Generator().manual_seed(3)
        parts = [torch.randn(5, HIDDEN, generator=g) for _ in range(2)]
        residual, weight = torch.randn(5, HIDDEN, generator=g), torch.randn(HIDDEN, generator=g)
        x, r = parts[rank].clone(), residual.clone()
        ParallelState(rank, 2, None, comm).all_reduce_add_rms_norm(x, r, weight, 1e-5)
        want_x, want_r = parts[0] + parts[1], residual.clone()
        fused_add_rms_norm_ref(want_x, want_r, weight, 1e-5)
        ok = torch.equal(x, want_x) and torch.equal(r, want_r)
        dist.destroy_process_group()
        q.put((rank, (comm, ok)))
    except BaseException as e:
        q.put((rank, f"{type(e).__name__}: {e}"))


def test_cpu_ranks_agree_on_nccl_and_sum_as_before() -> None:
    got = run_ranks(_rank, 2, (free_port(),), timeout_s=120)
    assert got == {0: (None, True), 1: (None, True)}, got


class _Handle:
    buffer_ptrs = (1 << 20, 2 << 20)  # addresses are only copied to the device here


def test_fits_only_its_rows_width_dtype_and_device() -> None:
    from kvscale.server.distributed.one_shot import OneShotAllReduce

    comm = OneShotAllReduce(0, 2, HIDDEN, torch.float16, 16, torch.zeros(8), _Handle())
    assert comm.data_ptrs.tolist() == [1 << 20, 2 << 20]
    assert comm.fits(torch.zeros(16, HIDDEN, dtype=torch.float16))
    assert comm.fits(torch.zeros(1, HIDDEN, dtype=torch.float16))
    assert not comm.fits(torch.zeros(17, HIDDEN, dtype=torch.float16))  # more rows than held
    assert not comm.fits(torch.zeros(4, HIDDEN + 1, dtype=torch.float16))
    assert not comm.fits(torch.zeros(4, HIDDEN, dtype=torch.float32))
    assert not comm.fits(torch.zeros(HIDDEN, 4, dtype=torch.float16).t())  # strided rows
    assert not comm.fits(torch.zeros(2, 4, HIDDEN, dtype=torch.float16))


def test_row_alignment() -> None:
    from kvscale.kernels.one_shot_all_reduce import row_alignment

    assert row_alignment(4096, 2) == 8  # bf16 rows of 8 KiB: 16-byte vectors
    assert row_alignment(4096, 4) == 4
    assert row_alignment(100, 4) == 4
    assert row_alignment(100, 2) == 1  # rows 200 bytes apart: no alignment to promise


def test_the_kernel_moves_rows_in_16_byte_vectors() -> None:
    """Compiled for sm_90 here (no GPU needed): the row stores into the peers' buffers
    and the loads of the peers' rows from the own buffer are 16-byte vector accesses,
    not 2-byte ones (lease r18's kernel)."""
    ptx = compile_one_shot_sm90().asm["ptx"]
    row_loads = [line for line in ptx.splitlines() if "ld.volatile.global" in line]
    stores = [line for line in ptx.splitlines() if "st.global" in line]
    assert row_loads and all(".v4.b32" in line for line in row_loads), row_loads[:3]
    assert stores and not [line for line in stores if ".b16" in line], stores[:3]


def test_flagged_words_move_without_flags_or_a_system_fence() -> None:
    """Compiled for sm_90: sums moved as flagged words store and poll 8-byte words (each
    holds its epoch, so a word is read whole or not at all) and make no flag atomics and
    no system-scope fence; with flags, the release is a fence and an atomic."""
    ll = compile_one_shot_sm90(ll=True).asm["ptx"]
    flags = compile_one_shot_sm90(ll=False).asm["ptx"]
    assert "atom." in flags and "atom." not in ll
    assert "st.global.b64" in ll and "ld.volatile.global.b64" in ll


@pytest.mark.parametrize("ll", [False, True], ids=["flags", "flagged-words"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_the_kernel_compiles_for_every_engine_dtype(dtype: str, ll: bool) -> None:
    """Compiled for sm_90: every dtype an engine runs, both protocols. Lease r72b's fp32
    flagged-words kernel did not compile (a 16-bit bitcast after a constexpr return), so
    its engines fell back to NCCL."""
    assert compile_one_shot_sm90(ll=ll, dtype=dtype).asm["cubin"]


def test_the_buffer_budget_limits_rows_for_wide_models_and_many_ranks() -> None:
    from kvscale.server.distributed.one_shot import MAX_BUFFER_BYTES, rows_within_budget

    assert rows_within_budget(4096, torch.bfloat16, 2) == 2048  # Llama-3.1-8B at TP=2
    assert rows_within_budget(4096, torch.float32, 2) == 1024
    assert rows_within_budget(8192, torch.bfloat16, 8) == 256  # 70B at TP=8
    assert rows_within_budget(8192, torch.bfloat16, 8) * 2 * 8 * 8192 * 2 <= MAX_BUFFER_BYTES
