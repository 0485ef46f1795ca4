"""Engine benchmarks on one GPU, with the peer (Hugging Face transformers) in the same run.

Model: Llama-3.1-8B shapes with random bf16 weights, written as an HF checkpoint and
loaded through the engine's real loader (and by transformers for the peer). Workloads:

- C, batch-1 latency: a 128-token prompt, 256 output tokens; time per output token
  (TPOT) and time to first token. Peer: ``generate`` (eager, sdpa).
- A, offline throughput: 256 requests of 512 input / 256 output tokens (ignore EOS).
  Peer: ``generate_batch`` (continuous batching, paged attention).
- B, offline throughput: 1,000 requests with the bench client's seeded ShareGPT-like
  lengths. Peer: ``generate_batch``.
- int4: C with the weights rewritten to 4 bits (round-to-nearest, groups of 128) in the
  GPTQ and AWQ layouts, against bf16's C of the same run and the 4-bit bandwidth floor.
- D, serving: ``kvscale serve`` under ``kvscale bench serve`` (ShareGPT-like lengths,
  text prompts that both servers tokenize to the same ids) at each concurrency. Peer:
  ``transformers serve --continuous-batching`` under the same client and prompts.
- Piecewise CUDA graphs (``--cuda-graph-mode full_and_piecewise``) measured apart, each
  against the default mode in the same lease: B offline (with the mean mixed-step time),
  D at c=64 and 256, and the start-up with an empty and a warm compile cache.

Tensor parallelism (two GPUs, not part of ``all``): ``tp1`` and ``tp2`` run C and A at
TP=1 and TP=2 (``tp2-nccl``: TP=2 with every all-reduce on NCCL, none one-shot),
``serve-tp2`` runs D at TP=2 (``serve`` gives TP=1), ``allreduce`` profiles TP=2 decode
steps (graph replays) for the all-reduce kernels' share of a step; the report adds a
TP=1 vs TP=2 table with the targets (C TPOT <= 0.62x, A >= 1.6x).

    python bench/engine_bench.py --phases ceilings,tp1,tp2,serve,serve-tp2,allreduce \
        --concurrency 64,256 --report

Each phase writes ``<out-dir>/phase_<name>.json`` as soon as it is done, and a phase whose
file exists is skipped (``--force`` reruns it), so a run can be resumed; ``--report``
assembles ``engine.json``, ``engine.md`` and ``serving.png`` from the phase files: each
figure next to the peer's, their ratio, and the roofline bound computed from the ceilings
measured in the same run (weights and KV bytes over copy bandwidth, FLOPs over the bf16
matmul rate).

    python bench/engine_bench.py --out-dir bench/results --phases all --report

The arithmetic (parameter counts, bounds), the step summary and the report are plain
functions tested on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LLAMA_31_8B: dict[str, Any] = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

MAX_MODEL_LEN = 2048
# The bounds' running sequences. The engines run at the server's defaults (256, or 1,024
# on GPUs of at least 70 GiB); A's and B's bounds are the same at either (their longest
# output sets the decode steps).
MAX_NUM_SEQS = 256
A_SHAPE = (256, 512, 256)  # requests, input tokens, output tokens
B_REQUESTS = 1000
C_SHAPE = (128, 256)  # prompt tokens, output tokens
# prefix caching: requests, groups, shared prefix, question, output tokens
PREFIX_SHAPE = (256, 8, 1024, 128, 128)
MULTI_TURN_SHAPE = (64, 4, 128, 128)  # conversations, turns, message, answer tokens
CONCURRENCIES = (1, 16, 64, 256)
# 4-bit weights: the bf16 checkpoint rewritten by round-to-nearest in each layout (GPTQ
# symmetric v1, the common Hub layout; AWQ GEMM with zero points), groups of 128
INT4_FORMATS = ("gptq", "awq")
INT4_GROUP = 128
INT4_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INT4_TARGET = 0.45  # C with int4 weights: at most this fraction of bf16's time per token
SEED = 0
PEER_SERVE_TIMEOUT_S = 300  # per concurrency level: the peer is ~10x slower than we are

PHASES = (  # in the order a full run takes them: the longest peer runs last
    "ceilings",
    "ours",
    "serve",
    "peer-latency",
    "peer-a",
    "eager",
    "compile",
    "peer-serve",
    "peer-b",
    "prefix",
    "prefix-noise",
    "prefix-interleaved",
    "prefix-noise-reversed",
    "fp8",
    "structured",
    "piecewise",
    "serve-piecewise",
    "piecewise-warm",
    "int4",
    "spec",
    "spec-piecewise",
    "decode-kernels",
    "decode-kernels-int4",
    "decode-kernels-a",
)
PIECEWISE_MODE = "full_and_piecewise"
PIECEWISE_CONCURRENCIES = (64, 256)
# two GPUs; run by name only
TP_PHASES = ("tp1", "tp2", "tp2-nccl", "serve-tp2", "allreduce", "c-tp2")
# comparisons of one change, run by name only (not in all); ``c`` (and ``c-tp2``), ``a``,
# ``b``: C, A or B alone, for engines compared one process each; ``b-pieces`` and
# ``b-pieces-eager``: B with piecewise graphs of Inductor's or of the traced (eager) pieces,
# each from an empty compile cache (start-up included); ``serve-pieces-eager``: D with the
# latter at --piecewise-concurrency; ``c-auto`` and ``decode-kernels-auto``: C and its step
# by kernel under ``cuda_graph_mode=auto`` (NOTES e74); ``a-sampled``: A greedy, then A
# sampled (``SAMPLED``) in the same engine (NOTES e92)
NAMED_PHASES = (
    "spec-device",
    "c",
    "a",
    "b",
    "b-pieces",
    "b-pieces-eager",
    "serve-pieces-eager",
    "c-auto",
    "decode-kernels-auto",
    "a-sampled",
)
TP_TARGETS = {"C": 0.62, "A": 1.6}  # TP=2 / TP=1: TPOT at most, throughput at least
ALLREDUCE_BATCHES = (1, 64)
ALLREDUCE_STEPS = 20


def _sibling(name: str) -> Any:
    """A module next to this script (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


spec_bench = _sibling("spec_bench")
kernel_trace = _sibling("kernel_trace")


# ---------------------------------------------------------------- pure arithmetic
def param_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Llama-style model: embedding, LM head, the layers (``linear``: their
    matmuls' weights alone, the norms left out), total."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    n = cfg["num_hidden_layers"]
    embed = v * h
    head = 0 if cfg.get("tie_word_embeddings") else v * h
    total = embed + head + n * layer + h
    linear = n * (layer - 2 * h)
    return {"embed": embed, "lm_head": head, "layers": n * layer, "linear": linear, "total": total}


def kv_bytes_per_token(cfg: dict[str, Any], elem_bytes: int = 2) -> int:
    d = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * d * elem_bytes


def weight_bytes_per_step(cfg: dict[str, Any], elem_bytes: int = 2) -> int:
    """Every weight but the embedding table is read once per step."""
    p = param_counts(cfg)
    return (p["total"] - p["embed"]) * elem_bytes


def decode_step_floor_s(
    cfg: dict[str, Any], context_tokens: int, copy_bytes_per_s: float, elem_bytes: int = 2
) -> float:
    """One decode step reads every weight but the embedding table once, plus the KV
    cache of all ``context_tokens`` (summed over the batch)."""
    kv = context_tokens * kv_bytes_per_token(cfg, elem_bytes)
    return (weight_bytes_per_step(cfg, elem_bytes) + kv) / copy_bytes_per_s


def int4_weight_bytes_per_step(cfg: dict[str, Any], group: int, zeros: bool) -> int:
    """Bytes one decode step reads with 4-bit linear weights: half a byte per weight, an
    fp32 scale (and a uint8 zero point) per group of ``group`` inputs per output, and the
    LM head and norms in bf16 (the embedding table is only gathered from)."""
    p = param_counts(cfg)
    h, n = cfg["hidden_size"], cfg["num_hidden_layers"]
    norms = 2 * h * n + h
    linear = p["linear"]
    per_group = 4 + (1 if zeros else 0)
    return linear // 2 + linear // group * per_group + (p["lm_head"] + norms) * 2


def int4_decode_floor_s(
    cfg: dict[str, Any], context_tokens: int, copy_bytes_per_s: float, group: int, zeros: bool
) -> float:
    """Batch-1 step floor with 4-bit weights: their bytes plus the bf16 KV cache read."""
    kv = context_tokens * kv_bytes_per_token(cfg)
    return (int4_weight_bytes_per_step(cfg, group, zeros) + kv) / copy_bytes_per_s


def throughput_bound(
    cfg: dict[str, Any],
    lengths: list[tuple[int, int]],
    max_batch: int,
    copy_bytes_per_s: float,
    flop_per_s: float,
) -> dict[str, float]:
    """Roofline for an offline batch of ``(input, output)`` requests: the slower of
    compute (every token through every matmul, causal attention included) and memory
    (at least ``max(longest output, total output / max_batch)`` decode steps each reading
    the weights, plus every generated token reading its context's KV once). Returns
    seconds and the output tokens/s bound, and beside them ``serial_s`` (the matmuls or
    the weights' reads, the longer, then the KV reads, as kernels one after another run
    them; NOTES e64)."""
    p = param_counts(cfg)
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    total_out = sum(o for _, o in lengths)
    tokens = sum(i + o for i, o in lengths)
    linear = 2 * p["layers"] * tokens + 2 * p["lm_head"] * total_out
    # causal attention: token t attends to t tokens (QK^T and PV, 2 flops per MAC)
    pairs = sum((i + o) * (i + o + 1) // 2 for i, o in lengths)
    compute_s = (linear + 4 * pairs * h * n_layers) / flop_per_s
    steps = max(max(o for _, o in lengths), math.ceil(total_out / max_batch))
    kv_reads = sum(i * o + o * (o + 1) // 2 for i, o in lengths)  # context tokens read
    weights_s = steps * weight_bytes_per_step(cfg) / copy_bytes_per_s
    kv_s = kv_reads * kv_bytes_per_token(cfg) / copy_bytes_per_s
    memory_s = weights_s + kv_s
    bound_s = max(compute_s, memory_s)
    return {
        "compute_s": compute_s,
        "memory_s": memory_s,
        "bound_s": bound_s,
        "output_tok_per_s": total_out / bound_s,
        "serial_s": max(linear / flop_per_s, weights_s) + kv_s,
    }


def serving_bound(
    cfg: dict[str, Any],
    lengths: list[tuple[int, int]],
    concurrency: int,
    copy_bytes_per_s: float,
    flop_per_s: float | None = None,
) -> dict[str, float]:
    """Step floor with ``concurrency`` sequences decoding at the mean context (mean input
    plus half the mean output): the TPOT floor (ms) and the output tokens/s bound it
    allows. The memory floor reads the weights and that KV once a step. With
    ``flop_per_s`` the compute floor too: in a steady state each finished request is
    replaced by a new one, so every step also prefills ``batch * mean input / mean
    output`` prompt tokens; all the step's tokens pass every layer's matmuls, the decode
    rows the head, and each token attends to its context (a prompt token to half its
    prompt on average). The floor is the larger of the two (``memory_tpot_ms``,
    ``compute_tpot_ms`` beside it). ``serial_tpot_ms``: the step as its kernels run, one
    after another: the matmuls (or the weights' read, the longer) and then the decode
    rows' K/V read, which no matmul overlaps (NOTES e64)."""
    batch = min(concurrency, len(lengths))
    mean_in = statistics.fmean(i for i, _ in lengths)
    mean_out = statistics.fmean(o for _, o in lengths)
    ctx = mean_in + mean_out / 2
    memory_s = decode_step_floor_s(cfg, int(batch * ctx), copy_bytes_per_s)
    res = {"memory_tpot_ms": 1e3 * memory_s}
    step = memory_s
    if flop_per_s:
        p = param_counts(cfg)
        attn = 4 * cfg["hidden_size"] * cfg["num_hidden_layers"]  # flops a (token, key) pair
        prefill = batch * mean_in / mean_out
        matmul = 2 * p["layers"] * (batch + prefill) + 2 * p["lm_head"] * batch
        flops = matmul + attn * (batch * ctx + prefill * mean_in / 2)
        res["compute_tpot_ms"] = 1e3 * flops / flop_per_s
        step = max(step, flops / flop_per_s)
        matmul_s = matmul / flop_per_s
        weights_s = weight_bytes_per_step(cfg) / copy_bytes_per_s
        kv_s = batch * ctx * kv_bytes_per_token(cfg) / copy_bytes_per_s
        res["serial_tpot_ms"] = 1e3 * (max(matmul_s, weights_s) + kv_s)
    return {**res, "tpot_ms": 1e3 * step, "output_tok_per_s": batch / step}


@dataclass
class Row:
    workload: str
    metric: str
    ours: float
    peer: float | None
    bound: float | None
    higher_is_better: bool
    target: str


def format_table(rows: list[Row]) -> str:
    """Markdown: ours, peer, ratio (how many times better we are), bound, fraction."""
    lines = [
        "| workload | metric | kvscale | peer | kvscale vs peer | roofline bound | "
        "fraction of bound | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = frac = "n/a"
        if r.peer and r.ours:  # a count of 0 (failed requests) has no ratio
            x = r.ours / r.peer if r.higher_is_better else r.peer / r.ours
            ratio = f"{x:.2f}x"
        if r.bound and r.ours:
            f = r.ours / r.bound if r.higher_is_better else r.bound / r.ours
            frac = f"{100 * f:.1f}%"
        peer = f"{r.peer:.2f}" if r.peer is not None else "not run"
        bound = f"{r.bound:.2f}" if r.bound is not None else "n/a"
        lines.append(
            f"| {r.workload} | {r.metric} | {r.ours:.2f} | {peer} | {ratio} | {bound} | "
            f"{frac} | {r.target} |"
        )
    return "\n".join(lines)


# (step_s, wait_s, decode_rows, prefill_tokens[, gpu_s]) of one engine step
Step = tuple[Any, ...]


def summarize_steps(steps: list[Step]) -> dict[str, Any]:
    """Per-step ``(step_s, wait_s, decode_rows, prefill_tokens[, gpu_s])`` of the batch
    each step launched (``wait_s``: time blocked on the previous step's tokens, i.e. GPU
    time the host could not hide; ``gpu_s``: the stream's time from the step's first launch
    to its last one's end, None where not timed) -> counts and mean times (ms) of
    pure-decode and mixed steps, and the mean host time per step (step minus wait). A
    step's wait belongs to the step before it, so only ``gpu_ms`` compares one kind of
    step across engine settings (NOTES "e68 and e71 measured")."""
    decode = [x for x in steps if x[3] == 0]
    mixed = [x for x in steps if x[3] > 0]

    def mean_ms(xs: list[float]) -> float:
        return 1e3 * statistics.fmean(xs) if xs else 0.0

    gpu: dict[str, Any] = {}
    if steps and all(len(x) > 4 and x[4] is not None for x in steps):
        gpu = {
            "decode_gpu_ms": mean_ms([x[4] for x in decode]),
            "prefill_gpu_ms": mean_ms([x[4] for x in mixed]),
            "total_gpu_s": sum(x[4] for x in steps),
        }
    return {
        **gpu,
        "num_steps": len(steps),
        "decode_steps": len(decode),
        "decode_step_ms": mean_ms([x[0] for x in decode]),
        "decode_wait_ms": mean_ms([x[1] for x in decode]),
        "decode_mean_batch": statistics.fmean(x[2] for x in decode) if decode else 0.0,
        "prefill_steps": len(mixed),
        "prefill_step_ms": mean_ms([x[0] for x in mixed]),
        "host_ms": mean_ms([x[0] - x[1] for x in steps]),
        "total_step_s": sum(x[0] for x in steps),
    }


def b_lengths() -> list[tuple[int, int]]:
    """Workload B's and D's request lengths: the bench client's seeded ShareGPT-like ones."""
    from kvscale.bench_serve import sample_lengths

    return sample_lengths("sharegpt-like", B_REQUESTS, 0, 0, SEED, max_model_len=MAX_MODEL_LEN)


def serve_prompts(concurrency: int, peer: bool = False) -> int:
    """Requests per concurrency level: twice the concurrency (16 at least); the peer's
    batch-1 run takes 4 (its ~80 ms/token would take minutes for 16)."""
    if peer and concurrency == 1:
        return 4
    return max(16, 2 * concurrency)


def serve_lengths(concurrency: int, peer: bool = False) -> list[tuple[int, int]]:
    from kvscale.bench_serve import sample_lengths

    n = serve_prompts(concurrency, peer)
    return sample_lengths("sharegpt-like", n, 0, 0, SEED, max_model_len=MAX_MODEL_LEN)


def concurrency_levels(serve: dict[str, Any]) -> list[int]:
    """The concurrencies a serving phase's results hold (keys "1", "16", ...)."""
    return sorted(int(k) for k in serve if k.isdigit())


def build_rows(res: dict[str, Any]) -> tuple[list[Row], dict[str, Any]]:
    """The report's rows (and the bounds used) from the phase results present."""
    cfg = LLAMA_31_8B
    rows: list[Row] = []
    bounds: dict[str, Any] = {}
    ceil = res.get("ceilings")
    ours, peer_c = res.get("ours", {}), res.get("peer-latency", {})
    copy_bps = ceil["copy"] * 1e9 if ceil else None
    flops = ceil["matmul"] * 1e12 if ceil else None
    if copy_bps and flops:
        n, i, o = A_SHAPE
        bounds["C_tpot_floor_ms"] = 1e3 * decode_step_floor_s(cfg, sum(C_SHAPE), copy_bps)
        bounds["A"] = throughput_bound(cfg, [(i, o)] * n, MAX_NUM_SEQS, copy_bps, flops)
        bounds["B"] = throughput_bound(cfg, b_lengths(), MAX_NUM_SEQS, copy_bps, flops)
    if "latency" in ours:
        rows.append(
            Row(
                "C batch-1 latency",
                "TPOT (ms)",
                ours["latency"]["tpot_ms"],
                peer_c.get("tpot_ms"),
                bounds.get("C_tpot_floor_ms"),
                False,
                "<= 7.0 ms",
            )
        )
        for name, label in (("eager", "CUDA graphs off"), ("compile", "torch.compile on")):
            v = res.get(name, {}).get("latency")
            if v:
                rows.append(
                    Row(
                        f"C, {label}",
                        "TPOT (ms)",
                        v["tpot_ms"],
                        peer_c.get("tpot_ms"),
                        bounds.get("C_tpot_floor_ms"),
                        False,
                        "",
                    )
                )
        rows.append(
            Row(
                "C batch-1 latency",
                "TTFT (ms)",
                ours["latency"]["ttft_ms"],
                peer_c.get("ttft_ms"),
                None,
                False,
                "",
            )
        )
    rows += int4_rows(res, copy_bps)
    peer_a = res.get("peer-a", {}).get("output_tok_per_s")
    if "A" in ours:
        a_bound = bounds.get("A", {}).get("output_tok_per_s")
        rows.append(
            Row(
                "A 256 x 512/256",
                "output tok/s",
                ours["A"]["output_tok_per_s"],
                peer_a,
                a_bound,
                True,
                ">= 6000 and >= 10x peer",
            )
        )
        v = res.get("compile", {}).get("A")
        if v:
            rows.append(
                Row(
                    "A, torch.compile on",
                    "output tok/s",
                    v["output_tok_per_s"],
                    peer_a,
                    a_bound,
                    True,
                    "",
                )
            )
    if "B" in ours:
        rows.append(
            Row(
                f"B {B_REQUESTS} ShareGPT-like",
                "output tok/s",
                ours["B"]["output_tok_per_s"],
                res.get("peer-b", {}).get("output_tok_per_s"),
                bounds.get("B", {}).get("output_tok_per_s"),
                True,
                "",
            )
        )
    rows += piecewise_rows(res, bounds)
    serve, peer_serve = res.get("serve", {}), res.get("peer-serve", {})
    for c in concurrency_levels(serve):
        r, p = serve[str(c)], peer_serve.get(str(c), {})
        sb = serving_bound(cfg, serve_lengths(c), c, copy_bps, flops) if copy_bps else {}
        bounds[f"D_c{c}"] = sb
        target = "<= 12 ms, 0 failed" if c == 64 else ""
        for metric, key, hib, bound, tgt in (
            ("median TPOT (ms)", "median_tpot_ms", False, sb.get("tpot_ms"), target),
            ("p99 TPOT (ms)", "p99_tpot_ms", False, sb.get("tpot_ms"), ""),
            ("median TTFT (ms)", "median_ttft_ms", False, None, ""),
            ("output tok/s", "output_throughput", True, sb.get("output_tok_per_s"), ""),
        ):
            rows.append(Row(f"D serve c={c}", metric, r[key], p.get(key), bound, hib, tgt))
        rows.append(
            Row(
                f"D serve c={c}",
                "failed requests",
                r["failed_requests"],
                p.get("failed_requests"),
                None,
                False,
                "",
            )
        )
    return rows, bounds


def tp_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """TP=1 vs TP=2 from the ``tp1``/``tp2`` (or ``ours``) and ``serve``/``serve-tp2``
    phases: per metric both values, TP=2 / TP=1, the target and whether it is met."""
    rows: list[dict[str, Any]] = []
    tp1, tp2 = res.get("tp1") or res.get("ours", {}), res.get("tp2", {})

    def add(workload: str, metric: str, a: Any, b: Any, target: str = "", ok: Any = None) -> None:
        if a is None or b is None:
            return
        rows.append(
            {"workload": workload, "metric": metric, "tp1": a, "tp2": b,
             "ratio": b / a if a else None, "target": target, "met": ok}
        )  # fmt: skip

    c1, c2 = tp1.get("latency", {}), tp2.get("latency", {})
    if "tpot_ms" in c1 and "tpot_ms" in c2:
        ratio = c2["tpot_ms"] / c1["tpot_ms"]
        limit = TP_TARGETS["C"]
        add("C batch-1", "TPOT (ms)", c1["tpot_ms"], c2["tpot_ms"], f"<= {limit}x", ratio <= limit)
        add("C batch-1", "TTFT (ms)", c1.get("ttft_ms"), c2.get("ttft_ms"))
    a1, a2 = tp1.get("A", {}), tp2.get("A", {})
    if "output_tok_per_s" in a1 and "output_tok_per_s" in a2:
        ratio = a2["output_tok_per_s"] / a1["output_tok_per_s"]
        limit = TP_TARGETS["A"]
        add("A 256 x 512/256", "output tok/s", a1["output_tok_per_s"], a2["output_tok_per_s"],
            f">= {limit}x", ratio >= limit)  # fmt: skip
    s1, s2 = res.get("serve", {}), res.get("serve-tp2", {})
    for c in concurrency_levels(s2):
        if str(c) not in s1:
            continue
        for metric, key in (
            ("median TPOT (ms)", "median_tpot_ms"),
            ("median TTFT (ms)", "median_ttft_ms"),
            ("output tok/s", "output_throughput"),
            ("failed requests", "failed_requests"),
        ):
            add(f"D serve c={c}", metric, s1[str(c)][key], s2[str(c)][key])
    return rows


def format_tp_table(res: dict[str, Any]) -> str:
    """Markdown of ``tp_rows`` and the all-reduce's share of a TP=2 decode step."""
    rows = tp_rows(res)
    lines: list[str] = []
    if rows:
        lines += [
            "| workload | metric | TP=1 | TP=2 | TP=2 / TP=1 | target | met |",
            "|---|---|---:|---:|---:|---|---|",
        ]
        for r in rows:
            ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "n/a"
            met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
            lines.append(
                f"| {r['workload']} | {r['metric']} | {r['tp1']:.2f} | {r['tp2']:.2f} | {ratio} "
                f"| {r['target']} | {met} |"
            )
    for batch, a in sorted(res.get("allreduce", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"- TP=2 decode step at batch {batch}: {a['step_ms']:.2f} ms, all-reduce kernels "
            f"{a['nccl_ms'] + a.get('one_shot_ms', 0.0):.2f} ms (NCCL {a['nccl_ms']:.2f}, "
            f"one-shot with add + norm {a.get('one_shot_ms', 0.0):.2f}; "
            f"{100 * a['share_of_step']:.1f}% of the step, "
            f"{100 * a['share_of_gpu']:.1f}% of rank 0's kernel time)"
        )
    return "\n".join(lines)


def allreduce_share(
    kernels: list[tuple[str, float]], steps: int, step_ms: float
) -> dict[str, float]:
    """Rank 0's CUDA kernels over ``steps`` decode steps (``(name, microseconds)``) and
    the mean step time -> NCCL kernel time per step and its share of the step and of all
    kernel time."""
    total = sum(us for _, us in kernels)
    nccl = sum(us for name, us in kernels if "nccl" in name.lower())
    one_shot = sum(us for name, us in kernels if "one_shot" in name)
    reduce_ms = (nccl + one_shot) / steps / 1e3
    return {
        "steps": steps,
        "step_ms": step_ms,
        "gpu_ms": total / steps / 1e3,
        "nccl_ms": nccl / steps / 1e3,
        "one_shot_ms": one_shot / steps / 1e3,  # sums fused with the residual add + norm
        "share_of_step": reduce_ms / step_ms if step_ms else 0.0,
        "share_of_gpu": (nccl + one_shot) / total if total else 0.0,
    }


def piecewise_rows(res: dict[str, Any], bounds: dict[str, Any]) -> list[Row]:
    """Rows of the piecewise phases: each figure with piecewise graphs next to the same
    lease's default mode (in the peer column, so the ratio is the gain)."""
    rows: list[Row] = []
    pw = res.get("piecewise", {})
    base, new = pw.get("full_decode_only", {}), pw.get(PIECEWISE_MODE, {})
    if "B" in base and "B" in new:
        rows.append(
            Row(
                "B, piecewise graphs (vs default)",
                "output tok/s",
                new["B"]["output_tok_per_s"],
                base["B"]["output_tok_per_s"],
                bounds.get("B", {}).get("output_tok_per_s"),
                True,
                "~9,400 predicted",
            )
        )
        rows.append(
            Row(
                "B, piecewise graphs (vs default)",
                "mixed step (ms)",
                new["B"]["steps"]["prefill_step_ms"],
                base["B"]["steps"]["prefill_step_ms"],
                None,
                False,
                "",
            )
        )
    if "load_s" in base and "load_s" in new:
        rows.append(
            Row(
                "start-up, empty compile cache", "s", new["load_s"], base["load_s"], None, False, ""
            )
        )
    warm = res.get("piecewise-warm", {})
    if "warm_load_s" in warm and "load_s" in base:
        rows.append(
            Row(
                "start-up, warm compile cache",
                "s",
                warm["warm_load_s"],
                base["load_s"],
                None,
                False,
                "< 60 s",
            )
        )
    serve = res.get("serve-piecewise", {})
    base_s, new_s = serve.get("full_decode_only", {}), serve.get(PIECEWISE_MODE, {})
    for c in concurrency_levels(new_s):
        r, p = new_s[str(c)], base_s.get(str(c), {})
        target = "~15 ms predicted" if c == 256 else ""
        for metric, key, hib, tgt in (
            ("median TPOT (ms)", "median_tpot_ms", False, target),
            ("p99 TPOT (ms)", "p99_tpot_ms", False, ""),
            ("median TTFT (ms)", "median_ttft_ms", False, ""),
            ("output tok/s", "output_throughput", True, ""),
        ):
            row = Row(
                f"D c={c}, piecewise (vs default)", metric, r[key], p.get(key), None, hib, tgt
            )
            rows.append(row)
    return rows


def int4_rows(res: dict[str, Any], copy_bps: float | None) -> list[Row]:
    """C with 4-bit weights, one row per layout: its TPOT against kvscale's own bf16 TPOT
    (the "peer" column: the ratio is bf16 over int4) and the 4-bit bandwidth floor."""
    int4 = res.get("int4", {})
    bf16 = (int4.get("bf16") or res.get("ours", {})).get("latency", {}).get("tpot_ms")
    rows = []
    for fmt in INT4_FORMATS:
        lat = int4.get(fmt, {}).get("latency")
        if not lat:
            continue
        floor = None
        if copy_bps:
            zeros = fmt == "awq"
            floor = 1e3 * int4_decode_floor_s(
                LLAMA_31_8B, sum(C_SHAPE), copy_bps, INT4_GROUP, zeros
            )
        rows.append(
            Row(
                f"C int4 {fmt} (peer: kvscale bf16)",
                "TPOT (ms)",
                lat["tpot_ms"],
                bf16,
                floor,
                False,
                f"<= {INT4_TARGET}x bf16",
            )
        )
    return rows


def render_report(res: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Markdown and JSON of a run's phase results."""
    rows, bounds = build_rows(res)
    meta = res.get("meta", {})
    lines = ["# Engine benchmarks", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    if res.get("ceilings"):
        c = res["ceilings"]
        lines.append(
            f"- ceilings (same run): copy {c['copy']:.0f} GB/s, bf16 matmul "
            f"{c['matmul']:.0f} TFLOP/s"
        )
    lines += ["", format_table(rows), ""]
    tp = format_tp_table(res)
    if tp:
        lines += ["## Tensor parallelism (2 GPUs)", "", tp, ""]
    spec = spec_bench.format_spec_table(res.get("spec", {}))
    if spec:
        lines += ["## Speculative decoding", "", spec, ""]
    if any("(vs default)" in r.workload for r in rows):
        lines.append(
            "- rows marked (vs default) hold the default mode (full_decode_only), measured in "
            "the same lease, in the peer column"
        )
    for w in ("A", "B"):
        steps = res.get("ours", {}).get(w, {}).get("steps")
        if steps:
            lines.append(
                f"- {w} steps: "
                + ", ".join(
                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in steps.items()
                )
            )
    for c, err in res.get("peer-serve", {}).get("failed", {}).items():
        lines.append(f"- peer serve at c={c} did not complete: {err}")
    missing = [p for p in PHASES if p not in res]
    if missing:
        lines.append(f"- phases not run: {', '.join(missing)}")
    doc = {
        "meta": meta,
        "bounds": bounds,
        "rows": [asdict(r) for r in rows],
        "tp_rows": tp_rows(res),
        "spec_rows": spec_bench.spec_rows(res.get("spec", {})),
        "phases": res,
    }
    return "\n".join(lines) + "\n", doc


# ---------------------------------------------------------------- GPU runs
@contextlib.contextmanager
def _timed_steps(eng: Any) -> Iterator[list[Step]]:
    """Inside the block, times each engine step and the wait for the previous step's
    tokens inside it; on CUDA also its forward's stream time, as a pair of events
    (``gpu_times`` reads them). The engine is untimed again on leaving, so a later
    workload on it is timed once."""
    import torch

    from kvscale.server.worker.worker import PendingStep

    steps: list[Step] = []
    last: dict[str, Any] = {}
    # every step's forward pass goes through Worker.forward (launch() calls it too)
    forward, step, result = eng.worker.forward, eng.step, PendingStep.result
    cuda = eng.worker.device.type == "cuda"

    def timed_forward(step_input: Any) -> Any:
        n = step_input.new_tokens_per_seq
        last["decode"] = sum(1 for x in n if x == 1)
        last["prefill"] = sum(x for x in n if x > 1)
        if not cuda:
            return forward(step_input)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        out = forward(step_input)
        end.record()
        last["events"] = (start, end)
        return out

    def timed_result(self: Any) -> Any:
        t0 = time.perf_counter()
        out = result(self)
        last["wait"] = last.get("wait", 0.0) + time.perf_counter() - t0
        return out

    def timed_step() -> Any:
        t0 = time.perf_counter()
        last.clear()
        out = step()
        if "decode" in last:
            dt_s = time.perf_counter() - t0
            steps.append(
                (dt_s, last.get("wait", 0.0), last["decode"], last["prefill"], last.get("events"))
            )
        return out

    eng.worker.forward, eng.step = timed_forward, timed_step
    PendingStep.result = timed_result  # type: ignore[method-assign]
    try:
        yield steps
    finally:
        eng.worker.forward, eng.step = forward, step
        PendingStep.result = result  # type: ignore[method-assign]


def gpu_times(steps: list[Step]) -> list[Step]:
    """``steps`` with each step's pair of CUDA events (``_timed_steps``) read as seconds;
    call after the device is synchronized."""
    return [
        (*x[:4], x[4][0].elapsed_time(x[4][1]) / 1e3 if len(x) > 4 and x[4] else None)
        for x in steps
    ]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, 32000, (length - 1,), generator=g).tolist()] for _ in range(n)]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_gpu() -> None:
    import torch

    torch._dynamo.reset()  # compiled code (piecewise graphs) holds the model's weights
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class GcPauses:
    """The cyclic collector's passes while in the block (``gc.callbacks``): how many of
    each generation, their total and longest pause (ms), and the objects it tracked at
    the start. A pass inside a step that the GPU waits on lengthens that step. Entering
    walks the whole heap (tens of ms with a model loaded): enter outside timed work."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.total_ms = 0.0
        self.max_ms = 0.0
        self.tracked = 0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = 1e3 * (time.perf_counter() - self._t0)
        self.counts[info["generation"]] += 1
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)

    def __enter__(self) -> GcPauses:
        self.tracked = len(gc.get_objects())
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {
            "collections": self.counts,
            "pause_ms_total": self.total_ms,
            "pause_ms_max": self.max_ms,
            "tracked_objects": self.tracked,
            "frozen_objects": gc.get_freeze_count(),
        }


def _latency(llm: Any) -> dict[str, Any]:
    """C: one warm-up then three timed batch-1 requests; medians, and the collector's
    passes during the timed ones (``GcPauses``)."""
    from kvscale.server import SamplingParams

    eng = llm.engine
    n_in, n_out = C_SHAPE
    prompt = _prompts(1, n_in, 0)[0]
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)

    def request(i: int) -> dict[str, float]:
        eng.add_request(f"lat{i}", prompt, params)
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                out = o
        assert out is not None and len(out.outputs[0].token_ids) == n_out
        return out.metrics  # type: ignore[no-any-return]

    request(0)  # warm-up
    tpots, ttfts = [], []
    # entered before the first timed request arrives: its walk of the heap is in no TTFT
    with GcPauses() as pauses:
        for i in range(1, 4):
            m = request(i)
            ttfts.append(m["first_token_time"] - m["arrival_time"])
            tpots.append((m["finished_time"] - m["first_token_time"]) / (n_out - 1))
    # one more request, its steps timed (host, wait, GPU): not in the medians above
    with _timed_steps(eng) as steps:
        llm.generate([prompt], params)
        _sync()
    return {
        "tpot_ms": 1e3 * statistics.median(tpots),
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "runs": len(tpots),
        "gc": pauses.summary(),
        "steps": summarize_steps(gpu_times(steps)),
    }


def _timed_generate(llm: Any, prompts: list[list[int]], params: Any) -> tuple[Any, float, Any]:
    """``llm.generate(prompts, params)`` with its steps timed (``_timed_steps``): the
    outputs, the wall time (s, the device synchronized at both ends) and the steps."""
    with _timed_steps(llm.engine) as steps:
        _sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        _sync()
        wall = time.perf_counter() - t0
    return outs, wall, steps


GREEDY = {"temperature": 0.0}
# Llama 3.1 Instruct's generation_config.json: what a client that sets nothing samples with
SAMPLED = {"temperature": 0.6, "top_p": 0.9}


def _offline(
    llm: Any, prompts: list[list[int]], outputs: list[int], sampling: dict[str, float] = GREEDY
) -> dict[str, Any]:
    """Offline throughput of the given requests (ignore EOS), sampled with ``sampling``
    (SamplingParams fields; greedy by default)."""
    from kvscale.server import SamplingParams

    eng = llm.engine
    params = [SamplingParams(max_tokens=o, ignore_eos=True, **sampling) for o in outputs]
    # warm-up: every prompt's prefill and a decode step, untimed, so that the timed run
    # compiles no kernel variant (r73, r75: after 8 prompts only, a machine's first A
    # compiled inside its prefill steps, 246 ms each against 180, NOTES "e65 measured")
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, **sampling))
    eng.reset_prefix_cache()  # the warm-up's prompts must not be hits of the timed run
    before = eng.stats()
    outs, wall, steps = _timed_generate(llm, prompts, params)
    after = eng.stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(outputs), (n_out, sum(outputs))
    n_in = sum(len(p) for p in prompts)
    # time to first token of each request, all submitted at t0 (queueing included)
    ttft = [
        (o.metrics["first_token_time"] - o.metrics["arrival_time"]) * 1e3
        for o in outs
        if "first_token_time" in o.metrics
    ]
    return {
        "wall_s": wall,
        "ttft_ms": _spread(ttft),
        "requests": len(prompts),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "output_tok_per_s": n_out / wall,
        "total_tok_per_s": (n_out + n_in) / wall,
        "requests_per_s": len(prompts) / wall,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_hit_rate": _hit_rate(before, after),
        "steps": summarize_steps(gpu_times(steps)),
    }


def _spread(values: list[float]) -> dict[str, float]:
    """Mean, median and p99 of ``values`` (empty: {})."""
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "median": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)],
    }


def _hit_rate(before: Any, after: Any) -> float:
    """Prompt tokens found in the prefix cache over those looked up, between two stats."""
    q = after.prefix_cache_queries - before.prefix_cache_queries
    return (after.prefix_cache_hits - before.prefix_cache_hits) / q if q else 0.0


def _multi_turn(llm: Any, conversations: int, turns: int, msg: int, answer: int) -> dict[str, Any]:
    """Multi-turn chat offline: each turn's prompts (every conversation so far plus a new
    message) run as one batch after the previous turn's."""
    from kvscale.bench_serve import make_multi_turn_requests
    from kvscale.server import SamplingParams

    reqs = make_multi_turn_requests(conversations, turns, msg, answer, SEED)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    llm.generate([r.prompt_token_ids for r in reqs[:4]], params)  # warm-up
    eng.reset_prefix_cache()
    before = eng.stats()
    _sync()
    t0 = time.perf_counter()
    for t in range(turns):
        batch = reqs[t * conversations : (t + 1) * conversations]
        llm.generate([r.prompt_token_ids for r in batch], params)
    _sync()
    wall = time.perf_counter() - t0
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    return {
        "wall_s": wall,
        "requests": len(reqs),
        "input_tokens": n_in,
        "output_tokens": len(reqs) * answer,
        "total_tok_per_s": (n_in + len(reqs) * answer) / wall,
        "prefix_cache_hit_rate": _hit_rate(before, eng.stats()),
    }


def phase_prefix(ckpt: Path, **kw: Any) -> dict[str, Any]:
    """Prefix caching off and on: its cost at a 0% hit rate (workload A's random prompts)
    and its gain on shared system prompts and on multi-turn chat."""
    from kvscale.bench_serve import make_prefix_requests

    res: dict[str, Any] = {}
    n, groups, prefix, question, out = PREFIX_SHAPE
    shared = make_prefix_requests(n, groups, prefix, question, out, SEED)
    for caching in (False, True):
        key = "on" if caching else "off"
        llm = _llm(ckpt, enable_prefix_caching=caching, **kw)
        a_n, a_in, a_out = A_SHAPE
        res[f"A_{key}"] = _offline(llm, _prompts(a_n, a_in, 1), [a_out] * a_n)
        res[f"shared_prefix_{key}"] = _offline(
            llm, [r.prompt_token_ids for r in shared], [r.output_len for r in shared]
        )
        res[f"multi_turn_{key}"] = _multi_turn(llm, *MULTI_TURN_SHAPE)
        del llm
        _free_gpu()
    return res


PREFIX_REPEATS = 3


def phase_prefix_noise(
    ckpt: Path, order: tuple[bool, ...] = (False, True), **kw: Any
) -> dict[str, Any]:
    """Prefix caching's cost at a 0% hit rate against run-to-run noise: workload A
    ``PREFIX_REPEATS`` times with caching off, then on (``order``), one engine each,
    each run's output tok/s."""
    res: dict[str, Any] = {}
    a_n, a_in, a_out = A_SHAPE
    for caching in order:
        llm = _llm(ckpt, enable_prefix_caching=caching, **kw)
        runs = [
            _offline(llm, _prompts(a_n, a_in, 1 + r), [a_out] * a_n)["output_tok_per_s"]
            for r in range(PREFIX_REPEATS)
        ]
        res["on" if caching else "off"] = {"runs": runs, **_spread(runs)}
        del llm
        _free_gpu()
    return res


def phase_prefix_interleaved(ckpt: Path) -> dict[str, Any]:
    """The same comparison in one engine, runs alternating off / on ``PREFIX_REPEATS``
    times after a warm-up run, so neither mode gets its own engine, KV pool or GPU state:
    caching is switched between runs on the engine's block manager (its only user),
    the cache emptied before each run. Each run's prompts are new (0% hits)."""
    a_n, a_in, a_out = A_SHAPE
    llm = _llm(ckpt, enable_prefix_caching=True)
    blocks = llm.engine.block_manager
    _offline(llm, _prompts(a_n, a_in, 100), [a_out] * a_n)  # warm-up
    runs: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(PREFIX_REPEATS):
        for mode in ("off", "on"):
            llm.engine.reset_prefix_cache()
            blocks.enable_caching = mode == "on"
            prompts = _prompts(a_n, a_in, 200 + 2 * r + (mode == "on"))
            runs[mode].append(_offline(llm, prompts, [a_out] * a_n)["output_tok_per_s"])
    _close(llm)
    res: dict[str, Any] = {m: {"runs": v, **_spread(v)} for m, v in runs.items()}
    res["on_vs_off"] = res["on"]["mean"] / res["off"]["mean"] - 1
    return res


FP8_VARIANTS = {  # name -> engine settings, against phase "ours" (bf16)
    "fp8_weights": dict(quantization="fp8"),
    "fp8_weights_kv": dict(quantization="fp8", kv_cache_dtype="fp8"),
}


def phase_fp8(ckpt: Path, out_dir: Path) -> dict[str, Any]:
    """FP8 at load (weights; weights + KV cache) on the bf16 checkpoint: C and A offline,
    D at c=64, and the KV pool's size (tokens) next to bf16's."""
    res: dict[str, Any] = {}
    for name, kw in FP8_VARIANTS.items():
        r = phase_ours(ckpt, "CA", **kw)
        flags = tuple(f"--{k.replace('_', '-')}={v}" for k, v in kw.items())
        r["serve"] = phase_serve(ckpt, out_dir, [64], flags, tag=name)
        res[name] = r
    return res


STRUCTURED_SHAPE = (64, 256, 256)  # requests, prompt tokens, output tokens of a free request
# 128 digits: every constrained output has the same structure (about 256 tokens)
STRUCTURED_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 128,
    "maxItems": 128,
}


def phase_structured(ckpt: Path, **kw: Any) -> dict[str, Any]:
    """Structured outputs' cost: 64 requests decoding together with 0%, 50% and 100% of
    them constrained by a JSON schema. Constrained steps split the forward pass from the
    sampling (the masks need the previous step's tokens) and fill token bitmasks on the
    host; the decode step time against the 0% run is what that costs."""
    from kvscale.server import SamplingParams
    from kvscale.server.structured.params import StructuredOutputsParams

    llm = _llm(ckpt, **kw)
    eng = llm.engine
    n, plen, free_out = STRUCTURED_SHAPE
    prompts = _prompts(n, plen, 3)
    so = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    warm = SamplingParams(temperature=0, max_tokens=8, structured_outputs=so)
    llm.generate(prompts[:2], warm)  # compiles the grammar, builds the token tables
    fill_s: list[float] = []
    fill = eng.core.grammars.fill

    def timed_fill(*a: Any) -> Any:
        t0 = time.perf_counter()
        out = fill(*a)
        fill_s.append(time.perf_counter() - t0)
        return out

    eng.core.grammars.fill = timed_fill
    res: dict[str, Any] = {"requests": n, "prompt_tokens": plen, "schema": STRUCTURED_SCHEMA}
    for frac in (0.0, 0.5, 1.0):
        k = int(n * frac)
        params = [
            SamplingParams(temperature=0, max_tokens=4 * free_out, structured_outputs=so)
            if i < k
            else SamplingParams(temperature=0, max_tokens=free_out, ignore_eos=True)
            for i in range(n)
        ]
        eng.reset_prefix_cache()
        fill_s.clear()
        outs, wall, steps = _timed_generate(llm, prompts, params)
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        valid = sum(
            1
            for o in outs[:k]
            if len(json.loads(o.outputs[0].text)) == STRUCTURED_SCHEMA["minItems"]
        )
        res[f"constrained_{int(frac * 100)}"] = {
            "constrained": k,
            "valid_outputs": valid,
            "wall_s": wall,
            "output_tokens": n_out,
            "output_tok_per_s": n_out / wall,
            "fill_calls": len(fill_s),
            "fill_ms_mean": 1e3 * statistics.fmean(fill_s) if fill_s else 0.0,
            "steps": summarize_steps(gpu_times(steps)),
        }
    del llm
    _free_gpu()
    return res


# whether the serving client saves each request's TTFT and inter-token latencies
# (--serve-detailed; main sets it)
SERVE_DETAILED = False
# engine settings of every in-process engine, from --engine-arg KEY=VALUE (main sets it)
ENGINE_ARGS: dict[str, Any] = {}


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (KEY, VALUE as JSON where it parses, else the string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--engine-arg takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _llm(ckpt: Path, **kw: Any) -> Any:
    from kvscale.server import LLM

    settings: dict[str, Any] = dict(
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=0.9,
    )
    return LLM(str(ckpt), **{**settings, **ENGINE_ARGS, **kw})


def _close(llm: Any) -> None:
    """Stops a tensor-parallel engine's other ranks and frees the GPU (TP=1: frees)."""
    llm.engine.core.shutdown()
    _free_gpu()


def kernel_table(
    kernels: list[tuple[str, float]], steps: int, top: int = 25
) -> list[dict[str, Any]]:
    """CUDA kernels over ``steps`` steps (``(name, microseconds)``) -> the ``top`` kernel
    names by time: launches and microseconds per step, names cut by
    ``kernel_trace.short`` (to 90 characters, a launch grid kept)."""
    by: dict[str, list[float]] = {}
    for name, us in kernels:
        acc = by.setdefault(kernel_trace.short(name), [0.0, 0.0])
        acc[0] += 1
        acc[1] += us
    rows = [
        {"kernel": k, "calls_per_step": n / steps, "us_per_step": us / steps}
        for k, (n, us) in by.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def gap_table(
    gaps: dict[tuple[str, str], list[float]], steps: int, top: int = 10
) -> dict[str, Any]:
    """``kernel_trace.idle_gaps`` over ``steps`` steps -> the device's idle time per step
    (us) and the ``top`` places it idled (the event before, the event after): gaps and
    microseconds per step, largest first."""
    rows = [
        {
            "after": kernel_trace.short(a),
            "before": kernel_trace.short(b),
            "gaps_per_step": len(us) / steps,
            "us_per_step": sum(us) / steps,
        }
        for (a, b), us in gaps.items()
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"idle_us_per_step": sum(r["us_per_step"] for r in rows), "top": rows[:top]}


def _profile_decode(
    llm: Any, batches: Sequence[int], tag: str, prompt_len: int = 128
) -> dict[str, Any]:
    """Decode-only steps (CUDA-graph replays) at each batch size, after prompts of
    ``prompt_len`` tokens: the median synchronized step time, then the same steps under
    torch.profiler: every CUDA kernel of this process (rank 0's with tensor
    parallelism), with its launch grid (``kernel_trace``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvscale.server import SamplingParams

    eng = llm.engine
    res: dict[str, Any] = {}
    params = SamplingParams(temperature=0, max_tokens=4 * ALLREDUCE_STEPS, ignore_eos=True)
    for batch in batches:
        for i, p in enumerate(_prompts(batch, prompt_len, 40 + batch)):
            eng.add_request(f"{tag}{batch}-{i}", p, params)
        # the prefill (8,192-token steps), then decode only
        for _ in range(2 + -(-batch * prompt_len // 8192)):
            eng.step()
        times = []
        for _ in range(ALLREDUCE_STEPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(ALLREDUCE_STEPS):
                eng.step()
            torch.cuda.synchronize()
        while eng.has_unfinished_requests():
            eng.step()
        trace = kernel_trace.trace_of(prof)
        res[str(batch)] = {
            "step_ms": statistics.median(times),
            "kernels": kernel_trace.kernels_from_trace(trace),
            "idle": gap_table(
                kernel_trace.idle_gaps(kernel_trace.events_from_trace(trace)), ALLREDUCE_STEPS
            ),
        }
    return res


def phase_allreduce(ckpt: Path) -> dict[str, Any]:
    """TP=2 decode steps (CUDA-graph replays) under torch.profiler on rank 0: the NCCL
    kernels' time per step against the step's time (each step synchronized)."""
    llm = _llm(ckpt, tensor_parallel_size=2)
    res: dict[str, Any] = {}
    for batch, prof in _profile_decode(llm, ALLREDUCE_BATCHES, "ar").items():
        kernels = prof["kernels"]
        res[batch] = allreduce_share(kernels, ALLREDUCE_STEPS, prof["step_ms"])
        top: dict[str, float] = {}
        for name, us in kernels:
            if "nccl" in name.lower():
                top[name[:80]] = top.get(name[:80], 0.0) + us
        res[batch]["nccl_kernels_us"] = dict(sorted(top.items(), key=lambda kv: -kv[1])[:5])
        res[batch]["kernels"] = kernel_table(kernels, ALLREDUCE_STEPS)
        res[batch]["idle"] = prof["idle"]  # where rank 0's device waited (gap_table)
        print(f"allreduce batch {batch}: {json.dumps(res[batch])[:300]}", flush=True)
    _close(llm)
    return res


def phase_decode_kernels(
    ckpt: Path, batches: Sequence[int] = ALLREDUCE_BATCHES, prompt_len: int = 128, **kw: Any
) -> dict[str, Any]:
    """Where a TP=1 decode step's GPU time goes (batch 1 is workload C's step): the step
    time, the kernels' total and the gap between (launch and host time the GPU idles),
    the kernels by time per step, and where the device idled between them during the
    profiled (unsynchronized) steps (``gap_table``). ``kw``: engine settings."""
    llm = _llm(ckpt, **kw)
    res: dict[str, Any] = {}
    for batch, prof in _profile_decode(llm, batches, "dk", prompt_len).items():
        gpu_ms = sum(us for _, us in prof["kernels"]) / ALLREDUCE_STEPS / 1e3
        table = kernel_table(prof["kernels"], ALLREDUCE_STEPS)
        idle = prof["idle"]
        res[batch] = {"step_ms": prof["step_ms"], "gpu_ms": gpu_ms, "kernels": table, "idle": idle}
        print(
            f"decode kernels, batch {batch}: step {prof['step_ms']:.3f} ms, kernels "
            f"{gpu_ms:.3f} ms, {sum(r['calls_per_step'] for r in table):.0f} launches "
            f"a step in the top {len(table)}; the device idle "
            f"{idle['idle_us_per_step']:.1f} us a step (unsynchronized steps)",
            flush=True,
        )
        for r in table:
            print(
                f"  {r['us_per_step']:8.1f} us  x{r['calls_per_step']:5.1f}  {r['kernel']}",
                flush=True,
            )
    _close(llm)
    return res


def phase_decode_kernels_a(ckpt: Path) -> dict[str, Any]:
    """A's decode steps (256 sequences after 512-token prompts) kernel by kernel, in
    bf16 and in each FP8 variant: where FP8's decode steps stay slow (issue 23's FP8 A)."""
    res = {"bf16": phase_decode_kernels(ckpt, (A_SHAPE[0],), A_SHAPE[1])}
    for name, kw in FP8_VARIANTS.items():
        res[name] = phase_decode_kernels(ckpt, (A_SHAPE[0],), A_SHAPE[1], **kw)
    return res


def phase_ours(ckpt: Path, workloads: str = "CAB", **kw: Any) -> dict[str, Any]:
    from kvscale.bench_serve import make_requests

    t0 = time.perf_counter()
    llm = _llm(ckpt, **kw)
    res: dict[str, Any] = {
        "load_s": time.perf_counter() - t0,
        "kv_blocks": llm.engine.block_manager.num_blocks,
    }
    pw = llm.engine.worker.piecewise
    if pw is not None:
        st = pw.compile_backend.compiler.stats
        res["piecewise"] = {
            "compile_s": pw.compile_seconds,
            "capture_s": pw.capture_seconds,
            "sizes": list(pw.sizes),
            "pieces": len(pw.compile_backend.pieces),
            "compiled": st.compiled,
            "loaded": st.loaded,
            "shared": st.reused,
        }
    if "C" in workloads:
        res["latency"] = _latency(llm)
    if "A" in workloads:
        n, i, o = A_SHAPE
        res["A"] = _offline(llm, _prompts(n, i, 1), [o] * n)
    if "S" in workloads:  # A sampled as Llama 3.1's generation config asks
        n, i, o = A_SHAPE
        res["A_sampled"] = {**_offline(llm, _prompts(n, i, 1), [o] * n, SAMPLED), **SAMPLED}
    if "B" in workloads:
        lengths = b_lengths()
        reqs = make_requests(lengths, SEED)
        res["B"] = _offline(llm, [r.prompt_token_ids for r in reqs], [o for _, o in lengths])
    _close(llm)
    del llm
    _free_gpu()
    return res


def phase_piecewise(ckpt: Path, cache_dir: Path) -> dict[str, Any]:
    """B with the default mode and with piecewise graphs, in that order on one lease; the
    piecewise engine starts on an empty compile cache (phase ``piecewise-warm``, in a
    process of its own, then starts on the cache this one filled)."""
    res: dict[str, Any] = {"full_decode_only": phase_ours(ckpt, "B")}
    res[PIECEWISE_MODE] = phase_b_pieces(ckpt, cache_dir, "inductor")
    return res


def phase_b_pieces(ckpt: Path, cache_dir: Path, compiler: str) -> dict[str, Any]:
    """B with piecewise graphs whose pieces ``compiler`` made ("inductor" or "eager"),
    from an empty compile cache, so ``load_s`` is a first start's."""
    import shutil

    shutil.rmtree(cache_dir, ignore_errors=True)
    return phase_ours(
        ckpt,
        "B",
        cuda_graph_mode=PIECEWISE_MODE,
        piecewise_compiler=compiler,
        compile_cache_dir=str(cache_dir),
    )


def phase_piecewise_warm(ckpt: Path, cache_dir: Path) -> dict[str, Any]:
    """A piecewise engine's start-up on the compile cache phase ``piecewise`` filled."""
    t0 = time.perf_counter()
    llm = _llm(ckpt, cuda_graph_mode=PIECEWISE_MODE, compile_cache_dir=str(cache_dir))
    res: dict[str, Any] = {"warm_load_s": time.perf_counter() - t0}
    pw = llm.engine.worker.piecewise
    if pw is not None:
        res["warm_compile_s"] = pw.compile_seconds
        res["warm_capture_s"] = pw.capture_seconds
    _close(llm)
    return res


def phase_serve_piecewise(ckpt: Path, out_dir: Path, concurrencies: list[int]) -> dict[str, Any]:
    """D at the given concurrencies with the default mode, then with piecewise graphs."""
    cache = out_dir / "compile-cache"
    return {
        "full_decode_only": phase_serve(ckpt, out_dir, concurrencies, tag="default"),
        PIECEWISE_MODE: phase_serve(
            ckpt,
            out_dir,
            concurrencies,
            extra=["--cuda-graph-mode", PIECEWISE_MODE, "--compile-cache-dir", str(cache)],
            tag="piecewise",
        ),
    }


def write_int4_checkpoint(
    src: Path, dst: Path, fmt: str, group: int = INT4_GROUP, device: str = "cuda"
) -> Path:
    """``src`` (a sharded bf16 checkpoint) with every linear layer quantized to 4 bits by
    round-to-nearest on ``device``, written in the ``gptq`` (symmetric, v1) or ``awq``
    (GEMM, zero points) layout, shard by shard; other tensors are copied. The packing is
    kvscale's (``int4_formats``), checked against the formats' published packers in
    tests/test_int4_formats.py."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvscale.server.quantization.int4_formats import pack_awq, pack_gptq, quantize_rtn

    if fmt not in INT4_FORMATS:
        raise ValueError(f"fmt must be one of {INT4_FORMATS}, got {fmt!r}")
    tmp = dst.with_name(dst.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out: dict[str, Any] = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                mod, _, leaf = name.rpartition(".")
                if leaf != "weight" or mod.rpartition(".")[2] not in INT4_LINEARS:
                    out[name] = t
                    continue
                codes, scales, zeros = quantize_rtn(t.to(device), group, sym=fmt == "gptq")
                if fmt == "gptq":
                    qweight, qzeros = pack_gptq(codes, zeros, v1=True)
                    k = t.shape[1]
                    out[f"{mod}.g_idx"] = (torch.arange(k) // group).int()
                else:
                    qweight, qzeros = pack_awq(codes), pack_awq(zeros)
                out[f"{mod}.qweight"] = qweight.cpu()
                out[f"{mod}.qzeros"] = qzeros.cpu()
                out[f"{mod}.scales"] = scales.half().cpu()
        save_file(out, str(tmp / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (tmp / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    if fmt == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                 "sym": True, "checkpoint_format": "gptq"}  # fmt: skip
    else:
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                 "version": "gemm"}  # fmt: skip
    cfg["quantization_config"] = quant
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tmp.rename(dst)
    return dst


def int4_checkpoint(ckpt: Path, fmt: str) -> Path:
    """The 4-bit checkpoint in ``fmt`` beside ``ckpt``, written from it on first use."""
    path = ckpt.with_name(f"{ckpt.name}-{fmt}")
    if not path.is_dir():
        write_int4_checkpoint(ckpt, path, fmt)
    return path


def phase_int4(ckpt: Path, out_dir: Path) -> dict[str, Any]:
    """C (batch-1 TPOT) with 4-bit weights in each layout, written from the bf16
    checkpoint on first use, and bf16's C from the ``ours`` phase of this run (measured
    here when that phase has not run)."""
    res: dict[str, Any] = {"group_size": INT4_GROUP}
    ours = out_dir / "phase_ours.json"
    if ours.is_file() and "latency" in json.loads(ours.read_text()):
        res["bf16"] = {"latency": json.loads(ours.read_text())["latency"], "from": "ours"}
    else:
        llm = _llm(ckpt, cuda_graph_max_batch=16)
        res["bf16"] = {"latency": _latency(llm), "from": "int4"}
        del llm
        _free_gpu()
    for fmt in INT4_FORMATS:
        t0 = time.perf_counter()
        path = int4_checkpoint(ckpt, fmt)
        written = time.perf_counter()
        llm = _llm(path, cuda_graph_max_batch=16)
        res[fmt] = {
            "write_s": written - t0,
            "load_s": time.perf_counter() - written,
            "kv_blocks": llm.engine.block_manager.num_blocks,
            "latency": _latency(llm),
        }
        del llm
        _free_gpu()
    return res


def phase_peer_latency(ckpt: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    n_in, n_out = C_SHAPE
    prompt = torch.tensor([_prompts(1, n_in, 0)[0]], device="cuda")
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(n: int, model: Any = model) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(8)  # warm-up
    ttft = statistics.median(timed(1) for _ in range(3))
    full = timed(n_out)
    res = {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * (full - ttft) / (n_out - 1)}
    del model, timed
    _free_gpu()
    return res


def _peer_batch(ckpt: Path, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    """transformers' continuous batching (paged attention), the machinery of
    ``generate_batch``, with each request's own ``max_new_tokens`` (``generate_batch``
    takes one for all) and no EOS. Its set-up (cache sizing, CUDA graph warm-up) is
    left out of the timing, as our engine's loading is."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).to(_device())
    cfg = GenerationConfig(
        max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    hints = WorkloadHints(max(len(p) for p in prompts), max(outputs), len(prompts))
    with model.continuous_batching_context_manager(
        generation_config=cfg, block=True, timeout=30, workload_hints=hints
    ) as manager:
        _sync()
        t0 = time.perf_counter()
        for k, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
            manager.add_request(p, request_id=f"r{k}", max_new_tokens=o, eos_token_id=-1)
        n_out = done = 0
        while done < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"the peer stopped after {done} of {len(prompts)}")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"the peer failed request {result.request_id}")
                n_out += len(result.generated_tokens)
                done += 1
        _sync()
        wall = time.perf_counter() - t0
    del model, manager
    _free_gpu()
    n_in = sum(len(p) for p in prompts)
    return {
        "wall_s": wall,
        "output_tokens": n_out,
        "expected_output_tokens": sum(outputs),
        "output_tok_per_s": n_out / wall,
        "total_tok_per_s": (n_out + n_in) / wall,
        "requests_per_s": len(prompts) / wall,
    }


def phase_peer_a(ckpt: Path) -> dict[str, Any]:
    n, i, o = A_SHAPE
    return _peer_batch(ckpt, _prompts(n, i, 1), [o] * n)


def phase_peer_b(ckpt: Path) -> dict[str, Any]:
    from kvscale.bench_serve import make_requests

    lengths = b_lengths()
    reqs = make_requests(lengths, SEED)
    return _peer_batch(ckpt, [r.prompt_token_ids for r in reqs], [o for _, o in lengths])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer 200 in {timeout:.0f}s")


def _run_client(
    base: str, ckpt: Path, c: int, out_dir: Path, tag: str, backend: str, n: int, timeout: float
) -> dict[str, Any]:
    path = out_dir / f"serve_{tag}_c{c}.json"
    cmd = [
        sys.executable,
        "-m",
        "kvscale.cli",
        "bench",
        "serve",
        "--base-url",
        base,
        "--model",
        str(ckpt) if backend == "transformers" else "bench",
        "--dataset",
        "sharegpt-like",
        "--tokenizer",
        str(ckpt),
        "--backend",
        backend,
        "--num-prompts",
        str(n),
        "--request-rate",
        "inf",
        "--max-concurrency",
        str(c),
        "--seed",
        str(SEED),
        "--result-file",
        str(path),
        "--disable-tqdm",
        *(["--save-detailed"] if SERVE_DETAILED else []),
    ]
    subprocess.run(cmd, env=_env(), check=True, timeout=timeout)
    r = json.loads(path.read_text())
    print(
        f"{tag} c={c}: {r['output_throughput']:.0f} tok/s, median TPOT "
        f"{r['median_tpot_ms']:.1f} ms, median TTFT {r['median_ttft_ms']:.0f} ms, "
        f"failed {r['failed_requests']}",
        flush=True,
    )
    return r


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")


def _serve(
    cmd: list[str],
    ready_url: str,
    clients: Callable[[], dict[str, Any]],
    log_path: Path,
    ready_timeout: float = 600,
) -> dict[str, Any]:
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_http(ready_url, proc, ready_timeout)
            ready_s = time.perf_counter() - t0
            return {**clients(), "ready_s": ready_s}
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            _free_gpu()


def phase_serve(
    ckpt: Path,
    out_dir: Path,
    concurrencies: list[int],
    extra: Sequence[str] = (),
    tag: str = "kvscale",
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """D on kvscale serve (CUDA graphs on, defaults otherwise; ``extra`` flags added;
    on ``tensor_parallel_size`` GPUs), client results saved as ``serve_<tag>_c<N>.json``."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "kvscale.cli",
        "serve",
        "--model",
        str(ckpt),
        "--served-model-name",
        "bench",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-access-log",
        "--log-level",
        "warning",
        *extra,
    ]
    if tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
        tag = f"{tag}-tp{tensor_parallel_size}"

    def clients() -> dict[str, Any]:
        return {
            str(c): _run_client(base, ckpt, c, out_dir, tag, "kvscale", serve_prompts(c), 600)
            for c in concurrencies
        }

    res = _serve(cmd, f"{base}/ready", clients, out_dir / f"server_{tag}.log")
    res["command"] = " ".join(cmd[1:])
    return res


def phase_peer_serve(ckpt: Path, out_dir: Path, concurrencies: list[int]) -> dict[str, Any]:
    """D on ``transformers serve --continuous-batching`` (its defaults otherwise)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("transformers")
    cmd = [
        str(exe) if exe.exists() else "transformers",
        "serve",
        str(ckpt),
        "--continuous-batching",
        "--dtype",
        "bfloat16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]

    # its /v1/models lists the hub cache and answers 500 when that folder is missing
    Path(os.environ.get("HF_HUB_CACHE", Path.home() / ".cache/huggingface/hub")).mkdir(
        parents=True, exist_ok=True
    )

    def clients() -> dict[str, Any]:
        out: dict[str, Any] = {}
        # first request loads the CB manager (and compiles nothing we time)
        _run_client(base, ckpt, 1, out_dir, "warmup", "transformers", 1, 600)
        for c in concurrencies:
            try:
                out[str(c)] = _run_client(
                    base,
                    ckpt,
                    c,
                    out_dir,
                    "transformers",
                    "transformers",
                    serve_prompts(c, peer=True),
                    PEER_SERVE_TIMEOUT_S,
                )
            except (subprocess.SubprocessError, OSError) as e:
                # a killed client leaves the peer busy: higher levels would be skewed
                print(f"peer serve c={c} failed, stopping here: {e!r}", flush=True)
                out[str(c)] = {"error": repr(e)}
                break
        return out

    res = _serve(cmd, f"{base}/health", clients, out_dir / "server_transformers.log")
    failed = {k: v.pop("error") for k, v in res.items() if isinstance(v, dict) and "error" in v}
    res = {k: v for k, v in res.items() if k not in failed}
    res["failed"] = failed
    res["command"] = " ".join(cmd[1:])
    return res


def phase_ceilings() -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernels import Bench  # bench/kernels.py

    return Bench(quick=False).ceilings()


def run_meta() -> dict[str, Any]:
    import platform

    import torch
    import transformers
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpus": torch.cuda.device_count(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "params": param_counts(LLAMA_31_8B)["total"],
    }


def ensure_checkpoint(ckpt: Path) -> None:
    """Writes the random 8B-shaped checkpoint (on the GPU, ~16 GB) unless it exists. Its
    tokenizer is the 131k Tekken one: every id of the 128k vocabulary the random model
    samples decodes to text, so the server streams a chunk for (nearly) every token, as
    with a real model."""
    if (ckpt / "model.safetensors.index.json").is_file():
        return
    from kvscale.server.demo_model import write_random_checkpoint

    t0 = time.perf_counter()
    write_random_checkpoint(
        ckpt, "llama", LLAMA_31_8B, dtype="bfloat16", device="cuda", tokenizer="tekken"
    )
    print(f"wrote the 8B-shaped checkpoint in {time.perf_counter() - t0:.0f}s", flush=True)


def load_results(out_dir: Path) -> dict[str, Any]:
    res = {}
    for path in sorted(out_dir.glob("phase_*.json")):
        res[path.stem.removeprefix("phase_")] = json.loads(path.read_text())
    return res


def plot_serving(res: dict[str, Any], path: Path, title: str) -> None:
    """Output throughput and median/p99 TPOT against concurrency, ours and the peer's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    serve, peer = res.get("serve", {}), res.get("peer-serve", {})
    cs = concurrency_levels(serve)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for data, name, style in ((serve, "kvscale", "o-"), (peer, "transformers serve", "s-")):
        xs = [c for c in cs if str(c) in data]
        if not xs:
            continue
        a.plot(xs, [data[str(c)]["output_throughput"] for c in xs], style, label=name)
        b.plot(xs, [data[str(c)]["median_tpot_ms"] for c in xs], style, label=f"{name} median")
        b.plot(xs, [data[str(c)]["p99_tpot_ms"] for c in xs], style[0] + ":", label=f"{name} p99")
    ceil = res.get("ceilings")
    if ceil and cs:
        bnds = [
            serving_bound(
                LLAMA_31_8B, serve_lengths(c), c, ceil["copy"] * 1e9, ceil["matmul"] * 1e12
            )
            for c in cs
        ]
        a.plot(cs, [x["output_tok_per_s"] for x in bnds], "k--", lw=1, label="step bound")
        b.plot(cs, [x["tpot_ms"] for x in bnds], "k--", lw=1, label="step floor")
    a.set(
        xscale="log",
        yscale="log",
        xlabel="concurrency",
        ylabel="output tokens/s",
        title="throughput",
    )
    b.set(
        xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="time per output token"
    )
    for ax in (a, b):
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(out_dir: Path) -> str:
    res = load_results(out_dir)
    text, doc = render_report(res)
    (out_dir / "engine.md").write_text(text)
    (out_dir / "engine.json").write_text(json.dumps(doc, indent=2))
    if res.get("serve"):
        meta = res.get("meta", {})
        plot_serving(
            res,
            out_dir / "serving.png",
            f"Llama-3.1-8B shapes, bf16, {meta.get('gpu')}, {meta.get('date')}",
        )
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--ckpt", default="/tmp/llama31-8b-random")
    ap.add_argument(
        "--phases",
        default="all",
        help=f"comma list of {', '.join(PHASES)}; or all; ckpt only writes the checkpoint; "
        f"on two GPUs also {', '.join(TP_PHASES)} (not in all); by name only: "
        f"{', '.join(NAMED_PHASES)}",
    )
    ap.add_argument("--force", action="store_true", help="rerun phases that have results")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)))
    ap.add_argument("--piecewise-concurrency", default=",".join(map(str, PIECEWISE_CONCURRENCIES)))
    ap.add_argument("--report", action="store_true", help="write engine.md/.json and the plot")
    ap.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting of every in-process engine (e.g. max_num_batched_tokens=1024)",
    )
    ap.add_argument(
        "--serve-args",
        default="",
        help="more kvscale serve flags for the serve and serve-pieces-eager phases, one string",
    )
    ap.add_argument(
        "--serve-detailed",
        action="store_true",
        help="the serving client also saves each request's send time, TTFT and inter-token "
        "latencies in serve_<tag>_c<N>.json",
    )
    args = ap.parse_args(argv)
    global SERVE_DETAILED
    SERVE_DETAILED = args.serve_detailed
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    phases = PHASES if args.phases == "all" else tuple(p for p in args.phases.split(",") if p)
    unknown = set(phases) - {*PHASES, *TP_PHASES, *NAMED_PHASES, "ckpt"}
    if unknown:
        known = ", ".join(PHASES + TP_PHASES + NAMED_PHASES)
        ap.error(f"unknown phases {sorted(unknown)}; known: {known}")
    ckpt = Path(args.ckpt)
    conc = [int(c) for c in args.concurrency.split(",")]
    serve_args = shlex.split(args.serve_args)
    ENGINE_ARGS.update(parse_engine_arg(a) for a in args.engine_arg)
    if phases:
        ensure_checkpoint(ckpt)
    if "ckpt" in phases:
        phases = tuple(p for p in phases if p != "ckpt")
    if phases and not (out / "phase_meta.json").exists():
        (out / "phase_meta.json").write_text(json.dumps(run_meta()))
    runners: dict[str, Callable[[], Any]] = {
        "ceilings": phase_ceilings,
        "ours": lambda: phase_ours(ckpt),
        "serve": lambda: phase_serve(ckpt, out, conc, extra=serve_args),
        "peer-latency": lambda: phase_peer_latency(ckpt),
        "peer-a": lambda: phase_peer_a(ckpt),
        "peer-b": lambda: phase_peer_b(ckpt),
        "peer-serve": lambda: phase_peer_serve(ckpt, out, conc),
        "eager": lambda: phase_ours(ckpt, "C", enforce_eager=True),
        "compile": lambda: phase_ours(ckpt, "CA", compile=True),
        "prefix": lambda: phase_prefix(ckpt),
        "prefix-noise": lambda: phase_prefix_noise(ckpt),
        "prefix-interleaved": lambda: phase_prefix_interleaved(ckpt),
        "prefix-noise-reversed": lambda: phase_prefix_noise(ckpt, order=(True, False)),
        "fp8": lambda: phase_fp8(ckpt, out),
        "structured": lambda: phase_structured(ckpt),
        "tp1": lambda: phase_ours(ckpt, "CA"),
        "tp2": lambda: phase_ours(ckpt, "CA", tensor_parallel_size=2),
        "tp2-nccl": lambda: phase_ours(
            ckpt, "CA", tensor_parallel_size=2, disable_custom_all_reduce=True
        ),
        "serve-tp2": lambda: phase_serve(ckpt, out, conc, tensor_parallel_size=2),
        "allreduce": lambda: phase_allreduce(ckpt),
        "decode-kernels": lambda: phase_decode_kernels(ckpt),
        "decode-kernels-int4": lambda: phase_decode_kernels(int4_checkpoint(ckpt, "gptq")),
        "decode-kernels-a": lambda: phase_decode_kernels_a(ckpt),
        "piecewise": lambda: phase_piecewise(ckpt, out / "compile-cache"),
        "piecewise-warm": lambda: phase_piecewise_warm(ckpt, out / "compile-cache"),
        "serve-piecewise": lambda: phase_serve_piecewise(
            ckpt, out, [int(c) for c in args.piecewise_concurrency.split(",")]
        ),
        "int4": lambda: phase_int4(ckpt, out),
        "spec": lambda: spec_bench.phase_spec(ckpt, out, lambda **kw: _llm(ckpt, **kw), _close),
        "spec-piecewise": lambda: spec_bench.phase_spec_piecewise(
            ckpt, out, lambda **kw: _llm(ckpt, **kw), _close
        ),
        "c": lambda: phase_ours(ckpt, "C"),
        "c-auto": lambda: phase_ours(ckpt, "C", cuda_graph_mode="auto"),
        "decode-kernels-auto": lambda: phase_decode_kernels(ckpt, cuda_graph_mode="auto"),
        "a": lambda: phase_ours(ckpt, "A"),
        "a-sampled": lambda: phase_ours(ckpt, "AS"),
        "b": lambda: phase_ours(ckpt, "B"),
        "b-pieces": lambda: phase_b_pieces(ckpt, out / "compile-cache-b", "inductor"),
        "b-pieces-eager": lambda: phase_b_pieces(ckpt, out / "compile-cache-b", "eager"),
        "serve-pieces-eager": lambda: phase_serve(
            ckpt,
            out,
            [int(c) for c in args.piecewise_concurrency.split(",")],
            extra=[
                "--cuda-graph-mode",
                PIECEWISE_MODE,
                "--piecewise-compiler",
                "eager",
                *serve_args,
            ],
            tag="pieces-eager",
        ),
        "c-tp2": lambda: phase_ours(ckpt, "C", tensor_parallel_size=2),
        "spec-device": lambda: spec_bench.phase_spec_device(
            ckpt, out, lambda **kw: _llm(ckpt, **kw), _close
        ),
    }
    for name in phases:
        path = out / f"phase_{name}.json"
        if path.exists() and not args.force:
            print(f"[{name}] done before; skipped", flush=True)
            continue
        t0 = time.perf_counter()
        print(f"[{name}] running ...", flush=True)
        try:
            result = runners[name]()
        except Exception as e:  # report, keep the other phases
            traceback.print_exc()
            print(f"[{name}] FAILED after {time.perf_counter() - t0:.0f}s: {e!r}", flush=True)
            continue
        path.write_text(json.dumps(result, indent=2))
        print(
            f"[{name}] done in {time.perf_counter() - t0:.0f}s: {json.dumps(result)[:400]}",
            flush=True,
        )
    if args.report:
        print(report(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
