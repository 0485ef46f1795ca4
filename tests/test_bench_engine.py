"""The CPU-runnable parts of bench/engine_bench.py: parameter counts, bounds, the table."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

eb = load_bench("engine_bench")


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
    cfg = eb.LLAMA_31_8B
    b = eb.throughput_bound(cfg, [(512, 256)] * 256, 256, 3.0e12, 7.9e14)
    assert b["bound_s"] == max(b["compute_s"], b["memory_s"])
    assert b["output_tok_per_s"] == pytest.approx(256 * 256 / b["bound_s"])
    # 256 decode steps, each reading the weights and the whole batch's KV at mean context
    avg_ctx = 256 * (512 + 257 / 2)
    assert b["memory_s"] == pytest.approx(256 * eb.decode_step_floor_s(cfg, avg_ctx, 3.0e12))
    fast_memory = eb.throughput_bound(cfg, [(512, 256)] * 256, 256, 3.0e15, 7.9e14)
    assert fast_memory["bound_s"] == pytest.approx(fast_memory["compute_s"])
    # kernels one after another: the matmuls (here longer than 256 weight reads), then KV
    p = eb.param_counts(cfg)
    linear = (2 * p["layers"] * 256 * 768 + 2 * p["lm_head"] * 256 * 256) / 7.9e14
    kv = 256 * (512 * 256 + 256 * 257 // 2) * eb.kv_bytes_per_token(cfg) / 3.0e12
    assert linear > 256 * eb.weight_bytes_per_step(cfg) / 3.0e12
    assert b["serial_s"] == pytest.approx(linear + kv)
    assert b["serial_s"] > b["bound_s"]


def test_throughput_bound_counts_steps_beyond_one_batch() -> None:
    cfg = eb.LLAMA_31_8B
    one = eb.throughput_bound(cfg, [(10, 100)] * 256, 256, 3.0e12, 7.9e14)
    two = eb.throughput_bound(cfg, [(10, 100)] * 512, 256, 3.0e12, 7.9e14)
    w = eb.weight_bytes_per_step(cfg) / 3.0e12
    assert two["memory_s"] - 2 * one["memory_s"] == pytest.approx(0, abs=1e-9)
    assert one["memory_s"] > 100 * w  # 100 steps of weights plus KV reads
    mixed = eb.throughput_bound(cfg, [(10, 1000), (10, 1)], 256, 3.0e12, 7.9e14)
    assert mixed["memory_s"] > 1000 * w  # the longest output sets the step count


def test_serving_bound_is_the_decode_floor_at_the_concurrency() -> None:
    cfg = eb.LLAMA_31_8B
    lengths = [(200, 100), (400, 300)]
    one = eb.serving_bound(cfg, lengths, 1, 3.0e12)
    assert one["tpot_ms"] == pytest.approx(1e3 * eb.decode_step_floor_s(cfg, 300 + 100, 3.0e12))
    assert one["output_tok_per_s"] == pytest.approx(1e3 / one["tpot_ms"])
    many = eb.serving_bound(cfg, lengths, 64, 3.0e12)  # at most the 2 requests run
    assert many["output_tok_per_s"] == pytest.approx(2e3 / many["tpot_ms"])


def test_serving_bound_counts_the_prefill_each_step_carries() -> None:
    """With the matmul rate, a step also prefills the prompts of the requests that
    replace the finished ones (batch x mean input / mean output tokens): at 256
    sequences of D's lengths that compute floor is above the memory floor."""
    cfg = eb.LLAMA_31_8B
    p = eb.param_counts(cfg)
    lengths = [(200, 100), (200, 100)]
    b = eb.serving_bound(cfg, lengths, 2, 3.0e12, 1e12)
    prefill = 2 * 200 / 100
    linear = 2 * p["layers"] * (2 + prefill) + 2 * p["lm_head"] * 2
    attn = 4 * cfg["hidden_size"] * cfg["num_hidden_layers"] * (2 * 250 + prefill * 100)
    assert b["compute_tpot_ms"] == pytest.approx(1e3 * (linear + attn) / 1e12)
    assert b["tpot_ms"] == pytest.approx(max(b["compute_tpot_ms"], b["memory_tpot_ms"]))
    d = eb.serving_bound(cfg, eb.serve_lengths(256), 256, 3.0e12, 722e12)
    assert d["compute_tpot_ms"] > d["memory_tpot_ms"]
    assert d["tpot_ms"] == pytest.approx(d["compute_tpot_ms"])
    small = eb.serving_bound(cfg, eb.serve_lengths(1), 1, 3.0e12, 722e12)
    assert small["tpot_ms"] == pytest.approx(small["memory_tpot_ms"])  # batch 1: the weights


def test_serving_bound_serial_floor_adds_the_kv_read_to_the_matmuls() -> None:
    """Kernels one after another: the matmuls (or the weights' read), then the decode
    rows' K/V. At D's c=256 that is ~13.8 ms, the 14 ms target of issue 23 (NOTES e64)."""
    cfg = eb.LLAMA_31_8B
    p = eb.param_counts(cfg)
    lengths = [(200, 100), (200, 100)]
    b = eb.serving_bound(cfg, lengths, 2, 3.0e12, 722e12)
    prefill = 2 * 200 / 100
    matmul = (2 * p["layers"] * (2 + prefill) + 2 * p["lm_head"] * 2) / 722e12
    weights = eb.weight_bytes_per_step(cfg) / 3.0e12
    kv = 2 * 250 * eb.kv_bytes_per_token(cfg) / 3.0e12
    assert weights > matmul  # two sequences: the weights' read is the longer
    assert b["serial_tpot_ms"] == pytest.approx(1e3 * (weights + kv))
    d = eb.serving_bound(cfg, eb.serve_lengths(256), 256, 3.0e12, 722e12)
    assert d["serial_tpot_ms"] > d["tpot_ms"]
    assert 13.5 < d["serial_tpot_ms"] < 14.0


def test_serve_prompt_counts() -> None:
    assert [eb.serve_prompts(c) for c in (1, 16, 64, 256)] == [16, 32, 128, 512]
    assert eb.serve_prompts(1, peer=True) == 4 and eb.serve_prompts(64, peer=True) == 128


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
    assert s["decode_wait_ms"] == pytest.approx(16.0)
    assert s["host_ms"] == pytest.approx((5 + 3 + 10) / 3)
    assert eb.summarize_steps([])["decode_step_ms"] == 0.0
    assert "decode_gpu_ms" not in s  # no GPU time taken


class _Event:
    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms

    def elapsed_time(self, end: _Event) -> float:
        return end.t_ms - self.t_ms


def test_step_summary_reads_each_steps_gpu_time_from_its_events() -> None:
    steps = [
        (0.02, 0.015, 256, 0, (_Event(0.0), _Event(6.0))),
        (0.02, 0.017, 256, 0, (_Event(10.0), _Event(18.0))),
        (0.2, 0.19, 16, 8000, (_Event(20.0), _Event(120.0))),
    ]
    timed = eb.gpu_times(steps)
    assert [x[4] for x in timed] == pytest.approx([0.006, 0.008, 0.1])
    s = eb.summarize_steps(timed)
    assert s["decode_gpu_ms"] == pytest.approx(7.0)
    assert s["prefill_gpu_ms"] == pytest.approx(100.0)
    assert s["total_gpu_s"] == pytest.approx(0.114)
    # a step without events (CPU) leaves the GPU fields out
    assert "decode_gpu_ms" not in eb.summarize_steps(eb.gpu_times([*steps, (0.1, 0.0, 1, 0, None)]))


def _serve_result(tpot: float, tok_s: float, failed: int = 0) -> dict:
    return {
        "median_tpot_ms": tpot,
        "p99_tpot_ms": 2 * tpot,
        "median_ttft_ms": 50.0,
        "output_throughput": tok_s,
        "failed_requests": failed,
    }


def test_report_from_partial_phase_results() -> None:
    res = {
        "meta": {"gpu": "H100", "date": "2026-11-22"},
        "ceilings": {"copy": 3000.0, "matmul": 700.0},
        "ours": {
            "latency": {"tpot_ms": 6.0, "ttft_ms": 14.0},
            "A": {"output_tok_per_s": 9000.0, "steps": {"num_steps": 300, "host_ms": 1.5}},
        },
        "peer-latency": {"tpot_ms": 84.0, "ttft_ms": 45.0},
        "eager": {"latency": {"tpot_ms": 20.0, "ttft_ms": 30.0}},
        "serve": {"64": _serve_result(10.0, 2500.0), "command": "serve ..."},
        "peer-serve": {
            "64": _serve_result(100.0, 250.0, failed=1),
            "failed": {"256": "TimeoutExpired(300)"},
        },
    }
    text, doc = eb.render_report(res)
    assert "| C batch-1 latency | TPOT (ms) | 6.00 | 84.00 | 14.00x |" in text
    assert "| C, CUDA graphs off | TPOT (ms) | 20.00 | 84.00 | 4.20x |" in text
    assert "| A 256 x 512/256 | output tok/s | 9000.00 | not run |" in text
    assert "| D serve c=64 | median TPOT (ms) | 10.00 | 100.00 | 10.00x |" in text
    assert "| D serve c=64 | output tok/s | 2500.00 | 250.00 | 10.00x |" in text
    assert "| D serve c=64 | failed requests | 0.00 | 1.00 | n/a |" in text
    assert "phases not run: peer-a, compile, peer-b" in text
    assert "peer serve at c=256 did not complete: TimeoutExpired(300)" in text
    assert "A steps: num_steps 300, host_ms 1.50" in text
    floor = doc["bounds"]["C_tpot_floor_ms"]
    assert floor == pytest.approx(1e3 * eb.decode_step_floor_s(eb.LLAMA_31_8B, 384, 3.0e12))
    assert doc["bounds"]["D_c64"]["tpot_ms"] > floor
    assert [r["workload"] for r in doc["rows"]].count("D serve c=64") == 5


def test_report_files_from_a_results_folder(tmp_path: Path) -> None:
    import json

    (tmp_path / "phase_meta.json").write_text(json.dumps({"gpu": "H100", "date": "today"}))
    (tmp_path / "phase_ceilings.json").write_text(json.dumps({"copy": 3000.0, "matmul": 700.0}))
    serve = {str(c): _serve_result(6.0 + c / 16, 150.0 * c) for c in (1, 16, 64, 256)}
    (tmp_path / "phase_serve.json").write_text(json.dumps(serve))
    peer = {str(c): _serve_result(80.0, 12.0 * c) for c in (1, 16)}
    (tmp_path / "phase_peer-serve.json").write_text(json.dumps(peer))
    text = eb.report(tmp_path)
    assert "| D serve c=16 | output tok/s | 2400.00 | 192.00 | 12.50x |" in text
    assert (tmp_path / "engine.md").read_text() == text
    doc = json.loads((tmp_path / "engine.json").read_text())
    assert doc["meta"]["gpu"] == "H100" and doc["phases"]["serve"]["64"]["median_tpot_ms"] == 10.0
    png = (tmp_path / "serving.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_prefix_phase_measures_caching_off_and_on(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvscale.server import LLM

    monkeypatch.setattr(eb, "A_SHAPE", (4, 20, 3))
    monkeypatch.setattr(eb, "PREFIX_SHAPE", (8, 2, 48, 8, 3))
    monkeypatch.setattr(eb, "MULTI_TURN_SHAPE", (2, 3, 10, 3))
    monkeypatch.setattr(
        eb, "_llm", lambda ckpt, **kw: LLM(str(ckpt), device="cpu", num_kv_blocks=128, **kw)
    )
    res = eb.phase_prefix(llama_ckpt)
    for name in ("A", "shared_prefix", "multi_turn"):
        assert res[f"{name}_off"]["prefix_cache_hit_rate"] == 0.0
    assert res["A_on"]["prefix_cache_hit_rate"] == 0.0  # random prompts share nothing
    # 6 of 8 requests find their group's 48-token prefix (3 blocks of 16) cached
    assert res["shared_prefix_on"]["prefix_cache_hit_rate"] == pytest.approx(6 * 48 / (8 * 56))
    # turns of 10, 23 and 36 tokens: the third finds the second's one full block cached
    assert res["multi_turn_on"]["prefix_cache_hit_rate"] == pytest.approx(2 * 16 / (2 * 69))
    assert res["shared_prefix_on"]["output_tokens"] == 8 * 3


def test_prefix_interleaved_phase_switches_caching_between_runs_of_one_engine(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvscale.server import LLM

    engines: list[LLM] = []

    def make(ckpt: Path, **kw: object) -> LLM:
        engines.append(LLM(str(ckpt), device="cpu", num_kv_blocks=128, **kw))  # type: ignore[arg-type]
        return engines[-1]

    cached_after: list[int] = []
    measured: list[tuple[bool, float]] = []  # (caching on, output tok/s) per run
    offline = eb._offline

    def recorded(llm: LLM, *a: object) -> dict:
        res = offline(llm, *a)
        cached_after.append(len(llm.engine.block_manager.cached))
        measured.append((llm.engine.block_manager.enable_caching, res["output_tok_per_s"]))
        return res

    monkeypatch.setattr(eb, "A_SHAPE", (4, 40, 3))
    monkeypatch.setattr(eb, "_llm", make)
    monkeypatch.setattr(eb, "_offline", recorded)
    res = eb.phase_prefix_interleaved(llama_ckpt)
    assert len(engines) == 1
    assert len(res["off"]["runs"]) == len(res["on"]["runs"]) == eb.PREFIX_REPEATS
    # warm-up (on), then off, on, off, on, ...: only the "on" runs register blocks
    # (4 prompts of 40 tokens + 3 outputs: 2 full blocks each)
    assert cached_after == [8] + [0, 8] * eb.PREFIX_REPEATS
    # each mode's runs are the throughputs measured while caching was in that mode
    for mode, caching in (("on", True), ("off", False)):
        assert res[mode]["runs"] == [tps for on, tps in measured[1:] if on == caching]


def test_structured_phase_measures_constrained_fractions(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvscale.server import LLM

    monkeypatch.setattr(eb, "STRUCTURED_SHAPE", (4, 12, 6))
    schema = {**eb.STRUCTURED_SCHEMA, "minItems": 3, "maxItems": 3}
    monkeypatch.setattr(eb, "STRUCTURED_SCHEMA", schema)
    monkeypatch.setattr(
        eb, "_llm", lambda ckpt, **kw: LLM(str(ckpt), device="cpu", num_kv_blocks=128, **kw)
    )
    res = eb.phase_structured(llama_ckpt)
    assert [res[f"constrained_{p}"]["constrained"] for p in (0, 50, 100)] == [0, 2, 4]
    assert [res[f"constrained_{p}"]["valid_outputs"] for p in (0, 50, 100)] == [0, 2, 4]
    assert res["constrained_0"]["fill_calls"] == 0 and res["constrained_100"]["fill_calls"] > 0
    assert res["constrained_0"]["steps"]["decode_steps"] > 0


def test_tp_table_and_the_all_reduce_share() -> None:
    res = {
        "tp1": {"latency": {"tpot_ms": 7.0, "ttft_ms": 20.0}, "A": {"output_tok_per_s": 9000.0}},
        "tp2": {"latency": {"tpot_ms": 4.2, "ttft_ms": 15.0}, "A": {"output_tok_per_s": 13500.0}},
        "serve": {"64": _serve_result(12.0, 4000.0)},
        "serve-tp2": {"64": _serve_result(8.0, 6000.0), "256": _serve_result(9.0, 9000.0)},
        "allreduce": {
            "1": eb.allreduce_share([("ncclDevKernel_AllReduce", 800.0), ("gemm", 3200.0)], 2, 2.5),
            "64": eb.allreduce_share(
                [("ncclDevKernel_AllReduce", 200.0), ("_one_shot_kernel", 600.0), ("gemm", 3200.0)],
                2,
                2.5,
            ),
        },
    }
    rows = {(r["workload"], r["metric"]): r for r in eb.tp_rows(res)}
    c = rows[("C batch-1", "TPOT (ms)")]
    assert c["ratio"] == pytest.approx(0.6) and c["met"] is True
    a = rows[("A 256 x 512/256", "output tok/s")]
    assert a["ratio"] == pytest.approx(1.5) and a["met"] is False
    assert ("D serve c=256", "output tok/s") not in rows  # no TP=1 run at c=256
    share = res["allreduce"]["1"]
    assert share["nccl_ms"] == pytest.approx(0.4) and share["share_of_step"] == pytest.approx(0.16)
    assert share["share_of_gpu"] == pytest.approx(0.2)
    mixed = res["allreduce"]["64"]  # the one-shot kernel counts as all-reduce time
    assert mixed["one_shot_ms"] == pytest.approx(0.3) and mixed["share_of_step"] == pytest.approx(
        0.16
    )
    text, doc = eb.render_report(res)
    assert "| C batch-1 | TPOT (ms) | 7.00 | 4.20 | 0.60x | <= 0.62x | yes |" in text
    assert "| A 256 x 512/256 | output tok/s | 9000.00 | 13500.00 | 1.50x | >= 1.6x | NO |" in text
    assert "| D serve c=64 | median TPOT (ms) | 12.00 | 8.00 | 0.67x |" in text
    assert (
        "batch 1: 2.50 ms, all-reduce kernels 0.40 ms (NCCL 0.40, one-shot with add + norm "
        "0.00; 16.0% of the step" in text
    )
    assert (
        "batch 64: 2.50 ms, all-reduce kernels 0.40 ms (NCCL 0.10, one-shot with add + norm 0.30;"
        in text
    )
    assert len(doc["tp_rows"]) == len(rows)


def test_kernel_table_sums_each_kernel_per_step_largest_first() -> None:
    kernels = [("gemm_a", 30.0), ("norm", 2.0), ("gemm_a", 34.0), ("norm", 2.5), ("x" * 120, 1.0)]
    table = eb.kernel_table(kernels, steps=2, top=2)
    assert table == [
        {"kernel": "gemm_a", "calls_per_step": 1.0, "us_per_step": 32.0},
        {"kernel": "norm", "calls_per_step": 1.0, "us_per_step": 2.25},
    ]
    assert eb.kernel_table(kernels, steps=1)[-1]["kernel"] == "x" * 90


def test_tp2_phase_runs_an_engine_over_two_cpu_ranks(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bench's instrumentation (patched launch and result) works through rank 0's
    driver: the phase the GPU run takes, on two gloo ranks."""
    from kvscale.server import LLM

    monkeypatch.setattr(eb, "A_SHAPE", (4, 20, 3))
    monkeypatch.setattr(eb, "C_SHAPE", (12, 4))
    monkeypatch.setattr(
        eb, "_llm", lambda ckpt, **kw: LLM(str(ckpt), device="cpu", num_kv_blocks=64, **kw)
    )
    res = eb.phase_ours(llama_ckpt, "CA", tensor_parallel_size=2)
    assert res["A"]["output_tokens"] == 4 * 3 and res["A"]["steps"]["num_steps"] > 0
    assert res["latency"]["tpot_ms"] > 0
    assert len(res["latency"]["gc"]["collections"]) == 3  # the collector's passes, by generation
    c_steps = res["latency"]["steps"]  # the extra timed request: its prefill, then decodes
    assert c_steps["prefill_steps"] == 1 and c_steps["decode_steps"] >= 2


def test_b_pieces_phase_starts_from_an_empty_compile_cache(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """B with piecewise graphs of traced pieces: the phase empties the cache folder first
    (a first start's load_s), the engine runs the mixed steps through the pieces."""
    from kvscale.server import LLM

    settings: list[dict] = []

    def make(ckpt: Path, **kw: object) -> LLM:
        settings.append(kw)
        return LLM(str(ckpt), device="cpu", num_kv_blocks=128, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(eb, "_llm", make)
    monkeypatch.setattr(eb, "b_lengths", lambda: [(20, 3), (9, 4), (33, 2), (5, 3)])
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "stale").write_text("from an earlier run")
    res = eb.phase_b_pieces(llama_ckpt, cache, "eager")
    assert settings == [
        {
            "cuda_graph_mode": eb.PIECEWISE_MODE,
            "piecewise_compiler": "eager",
            "compile_cache_dir": str(cache),
        }
    ]
    assert not (cache / "stale").exists()
    assert res["B"]["output_tokens"] == 3 + 4 + 2 + 3 and res["B"]["steps"]["prefill_steps"] > 0
    assert res["piecewise"]["pieces"] > 0 and res["piecewise"]["loaded"] == 0
    assert res["load_s"] > 0


def test_report_rows_of_the_piecewise_phases() -> None:
    def b(tok_s: float, mixed_ms: float, load_s: float) -> dict:
        return {
            "load_s": load_s,
            "B": {"output_tok_per_s": tok_s, "steps": {"prefill_step_ms": mixed_ms}},
        }

    res = {
        "piecewise": {
            "full_decode_only": b(7776.0, 32.7, 15.0),
            eb.PIECEWISE_MODE: b(9400.0, 22.0, 75.0),
        },
        "piecewise-warm": {"warm_load_s": 40.0},
        "serve-piecewise": {
            "full_decode_only": {"256": _serve_result(22.5, 6875.0), "ready_s": 20.0},
            eb.PIECEWISE_MODE: {"256": _serve_result(15.0, 9000.0), "ready_s": 45.0},
        },
    }
    text, _ = eb.render_report(res)
    assert "| B, piecewise graphs (vs default) | output tok/s | 9400.00 | 7776.00 | 1.21x |" in text
    assert "| B, piecewise graphs (vs default) | mixed step (ms) | 22.00 | 32.70 | 1.49x |" in text
    assert "| start-up, warm compile cache | s | 40.00 | 15.00 | 0.38x |" in text
    assert "| D c=256, piecewise (vs default) | median TPOT (ms) | 15.00 | 22.50 | 1.50x |" in text
    assert "hold the default mode (full_decode_only)" in text


def test_profile_step_records_the_graph_each_launch_replays() -> None:
    from types import SimpleNamespace

    from kvscale.server.worker.graph_dispatch import GraphDispatcher

    ps = load_bench("profile_step")

    class Worker:
        dispatcher = GraphDispatcher(decode_sizes=(1, 2, 4), token_sizes=(8, 16))

        def launch(self, step: object) -> str:
            return "launched"

    cur: dict = {}
    timed = ps._timed(Worker().launch, cur)
    mixed = SimpleNamespace(new_tokens_per_seq=[1, 5], num_tokens=6, graph_size=0)
    assert timed(mixed) == "launched"
    assert cur["graph"] == "piecewise 8" and cur["tokens"] == 6.0 and cur["launch_ms"] >= 0
    timed(SimpleNamespace(new_tokens_per_seq=[1, 1, 1], num_tokens=4, graph_size=4))
    assert cur["graph"] == "full 4"
    timed(SimpleNamespace(new_tokens_per_seq=[20], num_tokens=20, graph_size=0))
    assert cur["graph"] == "eager"
    assert ps._fmt({"launch_ms": 1.234, "graph": "eager"}) == "launch_ms 1.23, graph eager"


def test_profile_spec_phase_busy_clips_the_gpu_union_to_each_range() -> None:
    ps = load_bench("profile_spec")

    def x(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        x("user_annotation", "phase:step", 0, 100),
        x("user_annotation", "phase:propose", 0, 40),
        x("user_annotation", "phase:wait", 60, 40),
        x("user_annotation", "other", 0, 100),  # not a phase
        x("gpu_user_annotation", "phase:step", 0, 100),  # the GPU's copy of a range
        x("kernel", "k1", 10, 20),  # 10-30
        x("kernel", "k2", 20, 20),  # 20-40: overlaps k1, union 10-40
        x("gpu_memcpy", "c", 50, 20),  # 50-70: half inside wait
        x("kernel", "k3", 90, 30),  # 90-120: 10 inside step and wait
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
    ]
    rows = ps.phase_busy(events)
    assert set(rows) == {"step", "propose", "wait"}
    assert rows["propose"] == {"wall_us": 40, "gpu_busy_us": 30, "n": 1}
    assert rows["wait"] == {"wall_us": 40, "gpu_busy_us": 20, "n": 1}
    assert rows["step"] == {"wall_us": 100, "gpu_busy_us": 60, "n": 1}


def test_int4_floor_is_about_a_third_of_bf16s() -> None:
    cfg = eb.LLAMA_31_8B
    p = eb.param_counts(cfg)
    linear = p["layers"] - 2 * 4096 * 32
    sym = eb.int4_weight_bytes_per_step(cfg, 128, zeros=False)
    assert sym == linear // 2 + linear // 128 * 4 + (p["lm_head"] + 2 * 4096 * 32 + 4096) * 2
    assert eb.int4_weight_bytes_per_step(cfg, 128, zeros=True) == sym + linear // 128
    ratio = eb.int4_decode_floor_s(cfg, 0, 3e12, 128, False) / eb.decode_step_floor_s(cfg, 0, 3e12)
    assert 0.3 < ratio < 0.35  # the bf16 LM head keeps it above a quarter
    assert eb.int4_decode_floor_s(cfg, 384, 3e12, 128, True) > eb.int4_decode_floor_s(
        cfg, 0, 3e12, 128, True
    )


def test_int4_rows_compare_with_bf16_of_the_same_run() -> None:
    res = {
        "ceilings": {"copy": 3000.0, "matmul": 700.0},
        "ours": {"latency": {"tpot_ms": 6.0, "ttft_ms": 20.0}},
        "int4": {"gptq": {"latency": {"tpot_ms": 2.5}}, "awq": {"latency": {"tpot_ms": 2.7}}},
    }
    rows = [r for r in eb.build_rows(res)[0] if r.workload.startswith("C int4")]
    assert [r.workload for r in rows] == [
        "C int4 gptq (peer: kvscale bf16)",
        "C int4 awq (peer: kvscale bf16)",
    ]
    assert rows[0].ours == 2.5 and rows[0].peer == 6.0 and rows[0].target == "<= 0.45x bf16"
    assert 1.5 < rows[0].bound < 1.7  # 4.8 GB over 3 TB/s
    table = eb.format_table(rows)
    assert "| 2.40x |" in table  # bf16 / int4
    res["int4"]["bf16"] = {"latency": {"tpot_ms": 5.0}}  # measured in the int4 phase
    assert eb.int4_rows(res, 3e12)[0].peer == 5.0


def test_int4_checkpoint_writer_on_cpu(tmp_path: Path) -> None:
    """The int4 phase's writer on a small sharded checkpoint: kvscale loads both layouts
    and its weights are the round-to-nearest ones (fp16-stored scales)."""
    import torch

    from kvscale.kernels.w4a16 import dequantize_w4
    from kvscale.server import LLM, SamplingParams
    from kvscale.server.demo_model import build_checkpoint
    from kvscale.server.quantization.int4_formats import quantize_rtn

    src = build_checkpoint(tmp_path / "dense", arch="llama", max_shard_size="2MB")
    assert (src / "model.safetensors.index.json").is_file()
    ref = LLM(str(src), device="cpu", num_kv_blocks=64).engine.worker.model
    w = ref.model.layers[1].mlp.down_proj.weight.detach()
    for fmt in eb.INT4_FORMATS:
        dst = eb.write_int4_checkpoint(src, tmp_path / fmt, fmt, group=128, device="cpu")
        cfg = json.loads((dst / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == fmt
        llm = LLM(str(dst), device="cpu", num_kv_blocks=64)
        layer = llm.engine.worker.model.model.layers[1].mlp.down_proj
        got = dequantize_w4(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, 128, w.shape[1])
        codes, scales, zeros = quantize_rtn(w, 128, sym=fmt == "gptq")
        want = (
            codes.float() - zeros.float().repeat_interleave(128, 0)
        ) * scales.half().float().repeat_interleave(128, 0)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4


def test_spec_bench_builds_a_draft_that_loads_and_agrees(llama_ckpt: Path, tmp_path: Path) -> None:
    """The draft checkpoint (first layer of the target) loads, and with the target's deeper
    layers damped, the pair's greedy tokens mostly agree."""
    from kvscale.server import LLM, SamplingParams

    sb = eb.spec_bench
    draft = sb.write_draft_checkpoint(llama_ckpt, tmp_path / "draft", layers=1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 5, 9, 200, 31], [1, 77, 78, 79]]
    target = LLM(str(llama_ckpt), device="cpu")
    sb.damp_deep_layers(target, first=1, scale=0.0)
    small = LLM(str(draft), device="cpu")
    got = [o.outputs[0].token_ids for o in target.generate(prompts, sp)]
    want = [o.outputs[0].token_ids for o in small.generate(prompts, sp)]
    assert got == want  # scale 0: the deeper layers add nothing, the pair is one model
    sb.make_echo(target)
    out = target.generate([[1, 5, 9]], sp)[0].outputs[0].token_ids
    assert out == [9] * 16


def test_spec_table() -> None:
    sb = eb.spec_bench
    run = {"tpot_ms": 2.0, "acceptance_rate": 0.8, "mean_accepted_length": 4.2,
           "propose_share": 0.012}  # fmt: skip
    base = {"tpot_ms": 5.0, "acceptance_rate": None, "mean_accepted_length": None}
    res = {"none": {"b1": base, "b256": base}, "draft-inprocess": {"b1": run, "b256": run}}
    rows = sb.spec_rows(res)
    assert rows[0] == {
        "config": "draft-inprocess", "batch": 1, "tpot_ms": 2.0, "base_tpot_ms": 5.0,
        "ratio": 0.4, "acceptance_rate": 0.8, "mean_accepted_length": 4.2,
        "propose_share": 0.012,
    }  # fmt: skip
    assert [r["batch"] for r in rows] == [1, 256]
    table = sb.format_spec_table(res)
    assert "| draft-inprocess | 1 | 2.00 | 5.00 | 0.40x | 0.80 | 4.20 | 1.2% |" in table


def test_engine_args_parse_as_json_where_they_can() -> None:
    assert eb.parse_engine_arg("max_num_batched_tokens=1024") == ("max_num_batched_tokens", 1024)
    assert eb.parse_engine_arg("cuda_graph_mode=auto") == ("cuda_graph_mode", "auto")
    assert eb.parse_engine_arg("enforce_eager=true") == ("enforce_eager", True)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        eb.parse_engine_arg("max_num_batched_tokens")


def test_gc_pauses_counts_each_generations_passes_and_their_time() -> None:
    eb = load_bench("engine_bench")
    with eb.GcPauses() as pauses:
        gc.collect()  # one full pass
        gc.collect(0)
    s = pauses.summary()
    assert s["collections"][2] >= 1 and s["collections"][0] >= 1
    assert s["pause_ms_total"] > 0 and 0 < s["pause_ms_max"] <= s["pause_ms_total"]
    assert s["tracked_objects"] > 1000  # the interpreter's own objects at least
    assert pauses._callback not in gc.callbacks  # removed on exit
    before = list(pauses.counts)
    gc.collect()
    assert pauses.counts == before  # nothing counted outside the block


def test_ours_times_each_workload_once_and_leaves_the_engine_untimed(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C, A and B on one engine (phase_ours): each workload's steps are timed by its own
    timers alone, and none is left on the engine after it (r88's B ran under A's too)."""
    from kvscale.server import LLM
    from kvscale.server.worker.worker import PendingStep

    engines: list[LLM] = []
    untimed: list[tuple[object, object, object]] = []

    def make(ckpt: Path, **kw: object) -> LLM:
        engines.append(LLM(str(ckpt), device="cpu", num_kv_blocks=128, **kw))  # type: ignore[arg-type]
        eng = engines[-1].engine
        untimed.append((eng.step, eng.worker.forward, PendingStep.result))
        return engines[-1]

    offline = eb._offline
    after: list[tuple[object, object, object]] = []

    def recorded(llm: LLM, *a: object) -> dict:
        res = offline(llm, *a)
        after.append((llm.engine.step, llm.engine.worker.forward, PendingStep.result))
        return res

    monkeypatch.setattr(eb, "_llm", make)
    monkeypatch.setattr(eb, "_offline", recorded)
    monkeypatch.setattr(eb, "C_SHAPE", (12, 4))
    monkeypatch.setattr(eb, "A_SHAPE", (4, 20, 3))
    monkeypatch.setattr(eb, "b_lengths", lambda: [(10, 3), (14, 5), (9, 2)])
    res = eb.phase_ours(llama_ckpt, "CAB")
    assert len(engines) == 1 and after == [untimed[0], untimed[0]]
    # B's steps as B ran them: 10 output tokens over 3 requests, its first step a prefill
    b = res["B"]["steps"]
    assert b["num_steps"] == b["decode_steps"] + b["prefill_steps"]
    assert 3 <= b["num_steps"] <= 10 and res["B"]["output_tokens"] == 10
