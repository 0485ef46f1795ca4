"""The one-shot all-reduce on 2 GPUs against NCCL: run on a machine with two GPUs.

    pytest -q tests/gpu/test_one_shot_cuda.py

Two NCCL processes set it up as the engine does (``setup_one_shot``: symmetric memory,
self-test; here for up to 512 rows) and compare, bit for bit, for 1 to 512 rows of 4096
in bf16 and fp32:
- the sum against ``dist.all_reduce``;
- the fused residual add + RMSNorm against NCCL's sum followed by the
  ``fused_add_rms_norm`` kernel (the unfused path), residual included;
- launch counts crossing int32's end, in row counts that mix the protocols;
- both again inside one CUDA graph holding many launches, replayed with new inputs;
- ``ParallelState`` taking NCCL for sums over the buffer's rows, with the same bits as the
  unfused path there too;
- a second set-up in the same process gives None on every rank (NCCL), without hanging.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.ports import free_port
from tests.spawned_ranks import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

HIDDEN = 4096
EPS = 1e-5
ROWS = [1, 2, 7, 16, 64, 256, 512]  # the buffer is set up for max(ROWS) rows here


def _check(rank: int, port: int, dtype: torch.dtype) -> list[str]:
    """One rank's comparisons; returns what differed (empty: all equal)."""
    import torch.distributed as dist

    from kvscale.kernels.rmsnorm import fused_add_rms_norm
    from kvscale.server.distributed.group import apply_env
    from kvscale.server.distributed.one_shot import setup_one_shot
    from kvscale.server.layers import ops
    from kvscale.server.parallel import ParallelState

    apply_env()
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device
    )
    comm = setup_one_shot(None, rank, 2, device, HIDDEN, dtype, max_rows=max(ROWS))
    if comm is None:
        return ["setup_one_shot gave None on a 2-GPU machine"]
    bad: list[str] = []
    g = torch.Generator(device=device).manual_seed(11 + rank)

    def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, HIDDEN, device=device, dtype=dtype, generator=g)
        residual = torch.randn(rows, HIDDEN, device=device, dtype=dtype, generator=g)
        weight = torch.randn(HIDDEN, device=device, dtype=dtype, generator=g)
        dist.broadcast(residual, 0)  # the residual and weights are the same on every rank
        dist.broadcast(weight, 0)
        return x, residual, weight

    def unfused(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> list[torch.Tensor]:
        x, residual = x.clone(), residual.clone()
        dist.all_reduce(x)
        fused_add_rms_norm(x, residual, weight, EPS)
        return [x, residual]

    for rows in ROWS:
        x, residual, weight = inputs(rows)
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        comm.all_reduce(got)
        if not torch.equal(got, want):
            bad.append(f"sum of {rows} rows")
        want_x, want_r = unfused(x, residual, weight)
        got_x, got_r = x.clone(), residual.clone()
        comm.all_reduce(got_x, got_r, weight, EPS)
        if not (torch.equal(got_x, want_x) and torch.equal(got_r, want_r)):
            bad.append(f"add + norm of {rows} rows")

    # launch counts about to wrap (int32), row counts mixing the protocols (flagged words
    # for small sums unless KVSCALE_ALLREDUCE_LL=0, flags above): still NCCL's bits
    torch.cuda.synchronize()
    dist.barrier()
    comm.uses.fill_(2**31 - 3)
    for rows in (1, 64, 2, 64, 1, 16, 64):
        x, residual, weight = inputs(rows)
        want_x, want_r = unfused(x, residual, weight)
        got_x, got_r = x.clone(), residual.clone()
        comm.all_reduce(got_x, got_r, weight, EPS)
        if not (torch.equal(got_x, want_x) and torch.equal(got_r, want_r)):
            bad.append(f"add + norm of {rows} rows, launch counts wrapping")

    # many launches in one graph (as a decode graph holds 65), replayed with new inputs
    rows = 8
    x, residual, weight = inputs(rows)
    sx, sr = x.clone(), residual.clone()
    comm.all_reduce(sx, sr, weight, EPS)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            comm.all_reduce(sx, sr, weight, EPS)
    for i in range(5):
        x, residual, _ = inputs(rows)
        want_x, want_r = x.clone(), residual.clone()
        for _ in range(10):
            want_x, want_r = unfused(want_x, want_r, weight)
        sx.copy_(x)
        sr.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        if not (torch.equal(sx, want_x) and torch.equal(sr, want_r)):
            bad.append(f"graph replay {i}")

    ops.use_kernels(True)  # the engine's routing on CUDA (the fallback's norm is a kernel)
    state = ParallelState(rank, 2, None, comm)  # past max_rows: NCCL, then the norm kernel
    for rows in (comm.max_rows, comm.max_rows + 1):
        x, residual, weight = inputs(rows)
        want_x, want_r = unfused(x, residual, weight)
        state.all_reduce_add_rms_norm(x, residual, weight, EPS)
        if not (torch.equal(x, want_x) and torch.equal(residual, want_r)):
            bad.append(f"ParallelState with {rows} rows")
    if setup_one_shot(None, rank, 2, device, HIDDEN, dtype) is not None:
        bad.append("a second set-up in one process was allowed")
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return bad


def _rank(rank: int, port: int, dtype: torch.dtype, q: Any) -> None:
    try:
        q.put((rank, _check(rank, port, dtype)))
    except BaseException as e:
        q.put((rank, [f"{type(e).__name__}: {e}"]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_one_shot_equals_nccl_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    got = run_ranks(_rank, 2, (free_port(), dtype), timeout_s=240)
    assert got == {0: [], 1: []}, got
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
