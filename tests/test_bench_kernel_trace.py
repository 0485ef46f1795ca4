"""CPU tests of bench/kernel_trace.py: device events read from a Chrome trace with their
launch grids, and the kernel table keeping the grid past the name's cut."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from tests.bench_scripts import load_bench

kt = load_bench("kernel_trace")
eb = load_bench("engine_bench")

SPLIT_K = "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT"
REDUCE = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, " + "x" * 40


def _trace() -> dict:
    """Kineto's shapes: kernels with grid and block in ``args``, copies without a grid,
    host-side events (``cpu_op``, ``cuda_runtime``) that are not the device's work."""
    return {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 3.0},
            {"ph": "X", "cat": "kernel", "name": SPLIT_K, "dur": 10.5,
             "args": {"grid": [64, 1, 4], "block": [384, 1, 1], "registers per thread": 168}},
            {"ph": "X", "cat": "kernel", "name": REDUCE, "dur": 1.7,
             "args": {"grid": [32, 1, 1], "block": [256, 1, 1]}},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)",
             "dur": 1.4, "args": {"bytes": 4}},
            {"ph": "X", "cat": "kernel", "name": SPLIT_K, "dur": 9.5,
             "args": {"grid": [64, 1, 2], "block": [384, 1, 1]}},
        ]
    }  # fmt: skip


def test_device_events_carry_their_grids_in_trace_order() -> None:
    got = kt.kernels_from_trace(_trace())
    assert got == [
        (f"{SPLIT_K} [grid 64,1,4]", 10.5),
        (f"{REDUCE[:90]} [grid 32,1,1]", 1.7),
        ("Memcpy DtoH (Device -> Pinned)", 1.4),
        (f"{SPLIT_K} [grid 64,1,2]", 9.5),
    ]


def test_the_kernel_table_keeps_grids_apart_and_past_the_name_s_cut() -> None:
    table = eb.kernel_table(kt.kernels_from_trace(_trace()), steps=1)
    assert [(r["kernel"], r["us_per_step"]) for r in table] == [
        (f"{SPLIT_K} [grid 64,1,4]", 10.5),
        (f"{SPLIT_K} [grid 64,1,2]", 9.5),
        (f"{REDUCE[:90]} [grid 32,1,1]", 1.7),
        ("Memcpy DtoH (Device -> Pinned)", 1.4),
    ]


def test_a_real_profile_exports_a_trace_the_reader_takes() -> None:
    """On the CPU no device events exist: the export and the read still work (the GPU
    runs fill them)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4) @ torch.ones(4)
    assert kt.cuda_kernels(prof) == []
