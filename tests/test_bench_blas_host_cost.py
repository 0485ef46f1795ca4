"""CPU test of bench/blas_host_cost.py: a row per layer and row count, with the host time
a call (the libraries themselves need a GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.bench_scripts import load_bench

bhc = load_bench("blas_host_cost")


def test_one_positive_host_time_per_layer_and_row_count() -> None:
    rows = bhc.measure(torch.device("cpu"), [1, 4], ["default"], calls=3, scale=64)
    assert [(r["layer"], r["rows"]) for r in rows] == [
        (name, m) for name in ("qkv", "o", "gate_up", "down") for m in (1, 4)
    ]
    assert all(r["library"] == "default" and r["host_us"] > 0 for r in rows)


def test_main_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bhc.main([])
