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
    trace = kt.trace_of(prof)  # a profile exports once: read its trace once
    assert kt.kernels_from_trace(trace) == []
    assert trace["traceEvents"]  # the host's events are there, with start times
    assert all("ts" in e for e in trace["traceEvents"] if e.get("ph") == "X")
    assert eb.gap_table(kt.idle_gaps(kt.events_from_trace(trace)), steps=1) == {
        "idle_us_per_step": 0,
        "top": [],
    }


def test_idle_gaps_are_keyed_by_the_work_on_each_side_and_skip_overlaps() -> None:
    events = [  # (label, start us, duration us), out of order as a trace may list them
        ("graph_kernel", 20.0, 5.0),
        ("copy", 0.0, 2.0),
        ("inputs", 3.0, 1.0),  # 1 us after the copy ends
        ("long", 30.0, 20.0),
        ("inside_long", 35.0, 5.0),  # overlaps "long": no gap, and "long" still ends last
        ("after_long", 52.0, 1.0),  # 2 us after "long" ends at 50
    ]
    gaps = kt.idle_gaps(events)
    assert gaps == {
        ("copy", "inputs"): [1.0],
        ("inputs", "graph_kernel"): [16.0],
        ("graph_kernel", "long"): [5.0],
        ("long", "after_long"): [2.0],
    }


def test_gap_table_gives_the_idle_time_a_step_and_the_largest_places() -> None:
    gaps = {("a", "b"): [1.0, 3.0], ("b", "c"): [10.0], ("c", "a"): [0.5]}
    table = eb.gap_table(gaps, steps=2, top=2)
    assert table["idle_us_per_step"] == (4.0 + 10.0 + 0.5) / 2
    assert table["top"] == [
        {"after": "b", "before": "c", "gaps_per_step": 0.5, "us_per_step": 5.0},
        {"after": "a", "before": "b", "gaps_per_step": 1.0, "us_per_step": 2.0},
    ]


def test_device_events_keep_their_start_times() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 100.5, "dur": 2.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 90.0, "dur": 9.0},
    ]}  # fmt: skip
    assert kt.events_from_trace(trace) == [("k", 100.5, 2.0)]
