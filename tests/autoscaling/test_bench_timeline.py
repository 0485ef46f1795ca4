"""bench/autoscale_timeline.py draws a timeline (a synthetic one here; no scenario run)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.autoscaling.scenario import ScenarioParams
from tests.autoscaling.timeline import summarize
from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("autoscale_timeline")


def _timeline() -> dict[str, Any]:
    params = ScenarioParams()
    samples = []
    for i in range(120):
        t = 1000.0 + i * 0.5
        n = 1 if t < 1012 or t > 1050 else 3
        pods = {f"demo-{j}": {"kv": 0.8, "waiting": 1.0, "running": 4.0} for j in range(n)}
        samples.append({"t": t, "replicas": n, "ready": n, "pods": pods, "in_flight": 12})
    return {
        "params": params.__dict__,
        "load_start": 1010.0,
        "load_end": 1040.0,
        "drained": 1041.0,
        "samples": samples,
        "requests": [[1010.0 + k, 1011.0 + k, True] for k in range(30)],
        "events": [],
    }


def test_plot_writes_a_png(bench: ModuleType, tmp_path: Path) -> None:
    timeline = _timeline()
    out = tmp_path / "timeline.png"
    bench.plot(timeline, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    summary = summarize(timeline)
    assert summary["scalings"] == [(2.0, 1, 3), (40.5, 3, 1)]
    assert summary["direction_changes"] == 1 and summary["decreases_during_load"] == 0
