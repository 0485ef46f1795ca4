"""bench/triton_launch_cost.py on the kernels themselves: each kernel timed through its
wrapper and ``kernel[grid]``; on a GPU the direct launch writes what ``kernel[grid]``
writes, elsewhere it reports why it could not run."""

from __future__ import annotations

from typing import Any

from tests.bench_scripts import load_bench

tlc = load_bench("triton_launch_cost")


def test_each_kernel_is_timed_three_ways(device: Any) -> None:
    rows = tlc.measure(device, 1, 1)
    assert [r["kernel"] for r in rows] == ["rms_norm", "silu_and_mul", "fused_add_rms_norm"]
    assert all(r["wrapper_us"] > 0 for r in rows)
    for r in rows[:2]:
        assert r["jit_us"] > 0
        if device.type == "cuda":
            assert r["direct_equal"] is True and r["direct_us"] > 0, r
        else:
            assert "direct_error" in r  # no compiled kernel under the interpreter
