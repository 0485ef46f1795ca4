"""The CPU-runnable parts of bench/engine_bench.py: parameter counts, bounds, the table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "engine_bench", Path(__file__).resolve().parents[1] / "bench" / "engine_bench.py"
)
assert _spec and _spec.loader
eb = importlib.util.module_from_spec(_spec)
sys.modules["engine_bench"] = eb  # dataclasses look their module up here
_spec.loader.exec_module(eb)


def test_llama_8b_parameter_count_matches_published_size() -> None:
    p = eb.param_counts(eb.LLAMA_31_8B)
    assert p["total"] == pytest.approx(8.03e9, rel=2e-3)  # Llama-3.1-8B: 8.03 B
    assert p["embed"] == p["lm_head"] == 128256 * 4096


def test_batch1_floor_is_weights_over_bandwidth() -> None:
    cfg = eb.LLAMA_31_8B
    floor = eb.decode_step_floor_s(cfg, 0, 3.0e12)
    p = eb.param_counts(cfg)
    assert floor == pytest.approx((p["total"] - p["embed"]) * 2 / 3.0e12)
    assert 5.0e-3 < floor < 5.5e-3  # shared/anchors.md: 5.3 ms on a 3 TB/s H100
    assert eb.decode_step_floor_s(cfg, 1000, 3.0e12) > floor
    assert eb.kv_bytes_per_token(cfg) == 2 * 32 * 8 * 128 * 2


def test_throughput_bound_takes_the_slower_limit() -> None:
    b = eb.throughput_bound(eb.LLAMA_31_8B, 256, 512, 256, 3.0e12, 7.9e14)
    assert b["bound_s"] == max(b["compute_s"], b["memory_s"])
    assert b["output_tok_per_s"] == pytest.approx(256 * 256 / b["bound_s"])
    fast_memory = eb.throughput_bound(eb.LLAMA_31_8B, 256, 512, 256, 3.0e15, 7.9e14)
    assert fast_memory["bound_s"] == pytest.approx(fast_memory["compute_s"])


def test_table_ratios_and_fractions() -> None:
    rows = [
        eb.Row("C", "TPOT (ms)", 6.0, 80.0, 5.4, False, "<= 7"),
        eb.Row("A", "output tok/s", 6000.0, 500.0, 12000.0, True, ">= 6000"),
        eb.Row("A", "x", 1.0, None, None, True, ""),
    ]
    table = eb.format_table(rows)
    assert "| 13.33x | 5.40 | 90.0% |" in table  # lower is better: peer / ours
    assert "| 12.00x | 12000.00 | 50.0% |" in table
    assert "not run" in table


def test_step_summary_splits_decode_and_prefill_steps() -> None:
    s = eb.summarize_steps([(0.02, 0.015, 256, 0), (0.02, 0.017, 256, 0), (0.2, 0.19, 16, 8000)])
    assert s["decode_steps"] == 2 and s["prefill_steps"] == 1
    assert s["decode_step_ms"] == pytest.approx(20.0)
    assert s["decode_execute_ms"] == pytest.approx(16.0)
    assert s["host_outside_execute_ms"] == pytest.approx((5 + 3 + 10) / 3)
    assert eb.summarize_steps([])["decode_step_ms"] == 0.0
