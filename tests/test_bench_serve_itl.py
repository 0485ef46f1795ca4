"""CPU tests of bench/serve_itl.py: inter-token latencies split at the slow threshold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

si = load_bench("serve_itl")


def test_slow_steps_are_counted_per_request() -> None:
    ms = 1e-3
    # decode steps of 6 ms; request a runs through two 20 ms mixed steps, b through one
    a = [6 * ms, 20 * ms, 6 * ms, 6 * ms, 20 * ms]
    b = [6 * ms, 6 * ms, 20 * ms, 6 * ms]
    p = si.itl_profile([a, b, []], slow_factor=1.5)
    assert p["median_itl_ms"] == pytest.approx(6.0)
    assert p["slow_limit_ms"] == pytest.approx(9.0)
    assert p["slow_per_request"] == pytest.approx(1.5)
    assert p["slow_itl_ms"] == pytest.approx(20.0)
    assert p["fast_itl_ms"] == pytest.approx(6.0)
    assert p["slow_share"] == pytest.approx((40 / 58 + 20 / 38) / 2)


def test_a_run_without_details_is_refused() -> None:
    with pytest.raises(ValueError, match="--save-detailed"):
        si.itl_profile([[], []])


def test_the_table_has_a_row_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.json"
    path.write_text(json.dumps({"median_tpot_ms": 8.0, "itls": [[0.006, 0.02, 0.006]]}))
    assert si.main([str(path), str(path)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if str(path) in line]
    assert len(rows) == 2 and "| 8.00 | 6.00 | 1.00 | 20.00 | 6.00 |" in rows[0]
