"""CPU tests of bench/kernels.py: byte/FLOP arithmetic and report formatting (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("kernels")


def test_import_needs_no_cuda_or_triton(bench: ModuleType) -> None:
    assert "triton" not in vars(bench)
    assert bench.NUM_HEADS == 32 and bench.NUM_KV_HEADS == 8 and bench.HEAD_DIM == 128


def test_decode_bytes(bench: ModuleType) -> None:
    # B=64, ctx 4096, Llama-3.1-8B, bf16: K+V = 2 * 64 * 4096 * 8 * 128 * 2 bytes
    kv = 2 * 64 * 4096 * 8 * 128 * 2
    q_out = 2 * 64 * 32 * 128 * 2
    assert bench.decode_bytes(64, 4096, 32, 8, 128, 2) == kv + q_out == 1_074_790_400
    assert bench.decode_bytes(1, 1, 1, 1, 1, 4) == 2 * 4 + 2 * 4


def test_prefill_flops_count_the_causal_half(bench: ModuleType) -> None:
    assert bench.causal_pairs(1) == 1
    assert bench.causal_pairs(4) == 10  # 1 + 2 + 3 + 4
    # 2 matmuls x 2 FLOPs per multiply-add x visible pairs x heads x head_dim
    assert bench.prefill_flops([4], 2, 8) == 2 * 2 * 10 * 2 * 8
    flops = bench.prefill_flops([2048] * 8, 32, 128)
    assert flops == 8 * 4 * (2048 * 2049 // 2) * 32 * 128
    full = 8 * 4 * 2048 * 2048 * 32 * 128
    assert full / 2 < flops < full / 2 * 1.001


def test_elementwise_bytes(bench: ModuleType) -> None:
    t, h, i = 8192, 4096, 14336
    assert bench.rms_norm_bytes(t, h, 2) == 2 * (2 * t * h + h)
    assert bench.fused_add_rms_norm_bytes(t, h, 2) == 2 * (4 * t * h + h)
    assert bench.silu_and_mul_bytes(t, i, 2) == t * 2 * i * 2 + t * i * 2
    assert bench.rotary_bytes(t, 32, 8, 128, 2) == 2 * t * 40 * 128 * 2 + t * (128 * 4 + 8)
    assert bench.write_kv_cache_bytes(t, 8, 128, 2) == 2 * (2 * t * 8 * 128 * 2) + 8 * t
    # q, k and v in, rotated q and the cache's k and v out; cos/sin, position, slot
    fused = 2 * t * 48 * 128 * 2 + t * (128 * 4 + 8 + 8)
    assert bench.rope_and_write_kv_bytes(t, 32, 8, 128, 2) == fused
    assert bench.copy_bytes(1 << 30) == 2 << 30
    assert bench.matmul_flops(8192, 8192, 8192) == 2 * 8192**3


def test_rates(bench: ModuleType) -> None:
    assert bench.gb_per_s(3_000_000_000, 1000.0) == pytest.approx(3.0)
    assert bench.gb_per_s(2_000_000, 1.0) == pytest.approx(2.0)  # 2 MB in 1 ms
    assert bench.tflop_per_s(10**12, 1000.0) == pytest.approx(1.0)


def _results(bench: ModuleType) -> tuple[dict[str, float], list]:
    ceilings = {bench.COPY: 3000.0, bench.MATMUL: 700.0}
    # 2.7 TB/s of 3 TB/s = 90% (target 80%) -> pass
    decode = bench.make_result("paged_decode", "B=64", 1.0, 2_700_000_000, 1e-3, ceilings)
    # 250 TFLOP/s < 300 -> miss
    prefill = bench.make_result("paged_prefill", "8x2048", 1.0, 250 * 10**9, 1e-3, ceilings)
    # fast but wrong -> not a pass
    wrong = bench.make_result("rms_norm", "T=8192", 1.0, 2_900_000_000, 0.5, ceilings)
    return ceilings, [decode, prefill, wrong]


def test_make_result_fraction_and_status(bench: ModuleType) -> None:
    _, (decode, prefill, wrong) = _results(bench)
    assert decode.unit == "GB/s" and decode.value == pytest.approx(2700.0)
    assert decode.fraction == pytest.approx(0.9) and decode.passed
    assert prefill.unit == "TFLOP/s" and prefill.value == pytest.approx(250.0)
    assert prefill.fraction == pytest.approx(250 / 700) and not prefill.passed
    assert not wrong.passed
    assert bench.format_target(decode) == ">= 80% of copy"
    assert bench.format_target(prefill) == ">= 300 TFLOP/s"


def test_markdown_and_json(bench: ModuleType) -> None:
    ceilings, results = _results(bench)
    meta = {
        "gpu": "NVIDIA H100",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "date": "2025-01-01T00:00:00+00:00",
        "quick": False,
    }
    md = bench.format_markdown(meta, ceilings, results)
    lines = md.splitlines()
    assert lines[0] == "# Kernel benchmarks"
    assert "- GPU: NVIDIA H100" in lines and "- torch 2.11.0, triton 3.6.0" in lines
    assert "- copy: 3000.0 GB/s (device-to-device, bytes read + written)" in lines
    rows = [line for line in lines if line.startswith("| paged") or line.startswith("| rms")]
    assert len(rows) == 3
    header = next(line for line in lines if line.startswith("| kernel"))
    assert all(row.count("|") == header.count("|") for row in rows)
    assert rows[0] == (
        "| paged_decode | B=64 | 1000.0 | 2700.0 GB/s | 3000.0 GB/s (copy) | 90.0% "
        "| >= 80% of copy | 1.0e-03 | pass |"
    )
    assert rows[1].endswith("| miss |") and "35.7%" in rows[1]
    assert rows[2].endswith("| WRONG |")
    data = json.loads(bench.to_json(meta, ceilings, results))
    assert data["meta"] == meta and data["ceilings"] == ceilings
    assert [r["name"] for r in data["results"]] == ["paged_decode", "paged_prefill", "rms_norm"]
    assert data["results"][0]["passed"] is True and data["results"][0]["fraction"] == 0.9


def test_every_case_has_a_target(bench: ModuleType) -> None:
    for name, (ceiling, target, is_fraction) in bench.TARGETS.items():
        assert ceiling in (bench.COPY, bench.MATMUL), name
        assert target > 0 and (target <= 1) == is_fraction, name


def test_main_without_cuda_exits_cleanly(bench: ModuleType, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("has CUDA: main would run the benchmark")
    assert bench.main(["--out-dir", str(tmp_path), "--quick"]) == 2
    assert not list(tmp_path.iterdir())


def test_w4a16_bytes_and_shapes(bench: ModuleType) -> None:
    # 8B down_proj at batch 1: 14336 x 4096 half-byte weights, 112 groups of fp32 scales
    # and uint8 zeros per column, bf16 activations in and out
    k, n = 14336, 4096
    want = k * n // 2 + 112 * n * 5 + (k + n) * 2
    assert bench.w4a16_bytes(1, k, n, 128, zeros=True) == want
    assert bench.w4a16_bytes(1, k, n, 128, zeros=False) == want - 112 * n
    assert bench.w4a16_bytes(1, 200, 8, 128, zeros=False) == 200 * 8 // 2 + 2 * 8 * 4 + 208 * 2
    layers = {name: (k, n) for name, k, n in bench.W4A16_LAYERS}
    assert layers["qkv"] == (4096, 6144) and layers["gate_up"] == (4096, 28672)
    assert layers["down"] == (14336, 4096) and layers["o"] == (4096, 4096)


def test_w4a16_sweep_table(bench: ModuleType) -> None:
    cfg = {"BLOCK_N": 64, "SPLIT_K": 4}
    rows = [
        {"layer": "qkv", "m": 1, "config": cfg, "heuristic": True, "us": 10.0},
        {"layer": "qkv", "m": 1, "config": {**cfg, "SPLIT_K": 8}, "heuristic": False, "us": 8.0},
        {
            "layer": "qkv",
            "m": 1,
            "config": {**cfg, "SPLIT_K": 16},
            "heuristic": False,
            "us": 5.0,
            "rel_error": 0.5,
        },  # fast and wrong: not the best
        {"layer": "qkv", "m": 1, "config": cfg, "error": "out of resources"},
        {"layer": "o", "m": 1, "config": cfg, "error": "out of resources"},
    ]
    lines = bench.format_sweep(rows).splitlines()
    assert lines[2] == "| qkv | 1 | 10.0 | 8.0 | BLOCK_N=64 SPLIT_K=8 |"
    assert len(lines) == 3  # "o" had no timed config
