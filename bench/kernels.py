"""Benchmarks the Triton kernels at Llama-3.1-8B shapes on one CUDA GPU.

Each kernel is first checked against its torch reference (bf16, relative error
``||out - ref|| / ||ref|| < 2e-2``), then timed with ``triton.testing.do_bench`` (median).
Achieved bandwidth (bytes moved / time) or TFLOP/s is printed next to ceilings measured in
the same run: a large device-to-device copy (bytes read + written / time) and an 8192^3 bf16
matmul. Results go to ``<out-dir>/kernels.json`` and ``<out-dir>/kernels.md``.

    python bench/kernels.py [--out-dir bench/results] [--quick] [--only w4a16]
                            [--w4a16-sweep]

The attention group also times a mixed step shaped like workload B's (250 decode rows and
a 490-token prompt in one prefill-kernel call) with short sequences in their own small
tiles and all in one launch of the large ones.

The W4A16 GEMM (4-bit weights, groups of 128 with zero points) runs at each linear layer
of the 8B model: decode batches of 1 and 16 rows (CUDA-graph timed, bytes over the copy
ceiling) and a 4,096-token prefill (FLOP/s over the matmul ceiling), each next to the
bf16 ``torch.matmul`` of the same shape; ``--w4a16-sweep`` times alternative decode
tile/split configs and writes ``w4a16_sweep.json``.

Importing this module needs neither CUDA nor Triton; the byte/FLOP arithmetic and the
table formatting are plain functions (tested on CPU by tests/test_bench_kernels.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvscale.kernels.testing import LLAMA_8B_LINEARS

# Llama-3.1-8B
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
HIDDEN = 4096
INTERMEDIATE = 14336
ROPE_THETA = 500000.0
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
ELEMENTWISE_TOKENS = 8192
MIXED_DECODE_ROWS = 250  # workload B's mixed steps: ~250 decode rows and ~490 prompt tokens
MIXED_PROMPT = 490
MAX_REL_ERROR = 2e-2
# W4A16 GEMM: the 8B model's linear layers as (name, K, N), groups of 128 with zero points
W4A16_LAYERS = LLAMA_8B_LINEARS
W4A16_GROUP = 128
W4A16_DECODE_M = (1, 16)
W4A16_PREFILL_M = 4096
# decode configs the sweep tries beside the heuristic's (BLOCK_N, BLOCK_K, num_warps,
# num_stages); SPLIT_K is the heuristic's and its half and double
W4A16_SWEEP = ((32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 4), (64, 256, 4, 3),
               (128, 256, 8, 3), (64, 64, 4, 4), (128, 64, 4, 4))  # fmt: skip
# the one-row GEMV's (BLOCK_N, BLOCK_K, num_warps, num_stages): BLOCK_N = 128 a warp keeps
# the sums over K in each thread; split so that each program takes 1, 2 or 4 K tiles
W4A16_GEMV_SWEEP = ((128, 128, 1, 1), (128, 64, 1, 1), (256, 128, 2, 1), (256, 64, 2, 1),
                    (256, 32, 2, 1), (512, 64, 4, 1), (512, 128, 4, 1))  # fmt: skip
W4A16_GEMV_TILES = (1, 2, 4)

COPY = "copy"
MATMUL = "matmul"

# (name, ceiling, target, target is a fraction of the ceiling)
TARGETS: dict[str, tuple[str, float, bool]] = {
    "paged_decode": (COPY, 0.80, True),
    "paged_decode_split": (COPY, 0.70, True),
    "paged_prefill": (MATMUL, 300.0, False),
    # a mixed step of workload B: decode rows' K/V reads dominate (bytes over copy)
    "paged_prefill_mixed": (COPY, 0.60, True),
    "paged_prefill_mixed_one_launch": (COPY, 0.60, True),
    "rms_norm": (COPY, 0.75, True),
    "fused_add_rms_norm": (COPY, 0.75, True),
    "rotary_embedding": (COPY, 0.75, True),
    "silu_and_mul": (COPY, 0.75, True),
    "write_kv_cache": (COPY, 0.75, True),
    "rope_and_write_kv": (COPY, 0.75, True),
    # 4-bit weights: decode reads ~a quarter of bf16's bytes; prefill dequantizes in
    # registers and should keep most of the bf16 matmul rate
    "w4a16_decode": (COPY, 0.50, True),
    "w4a16_prefill": (MATMUL, 0.50, True),
}


# --------------------------------------------------------------------------- arithmetic
def decode_bytes(
    batch: int,
    context_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
) -> int:
    """K and V read for every cached token, q read, output written."""
    kv = 2 * batch * context_len * num_kv_heads * head_dim * elem_bytes
    q_and_out = 2 * batch * num_heads * head_dim * elem_bytes
    return kv + q_and_out


def causal_pairs(seq_len: int) -> int:
    """(query, key) pairs of a causal self-attention over ``seq_len`` tokens."""
    return seq_len * (seq_len + 1) // 2


def prefill_flops(seq_lens: list[int], num_heads: int, head_dim: int) -> int:
    """Causal attention FLOPs: QK^T and PV, 2 FLOPs per multiply-add, over visible pairs."""
    return sum(4 * causal_pairs(n) * num_heads * head_dim for n in seq_lens)


def rms_norm_bytes(tokens: int, hidden: int, elem_bytes: int) -> int:
    """Read x and weight, write out."""
    return (2 * tokens * hidden + hidden) * elem_bytes


def fused_add_rms_norm_bytes(tokens: int, hidden: int, elem_bytes: int) -> int:
    """Read x, residual and weight; write residual and x."""
    return (4 * tokens * hidden + hidden) * elem_bytes


def rotary_bytes(
    tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int
) -> int:
    """Read and write q and k; read an fp32 cos/sin row and an int64 position per token."""
    qk = 2 * tokens * (num_heads + num_kv_heads) * head_dim * elem_bytes
    return qk + tokens * (head_dim * 4 + 8)


def silu_and_mul_bytes(tokens: int, intermediate: int, elem_bytes: int) -> int:
    """Read ``[T, 2I]``, write ``[T, I]``."""
    return 3 * tokens * intermediate * elem_bytes


def write_kv_cache_bytes(tokens: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Read new K and V, write them to the cache, read an int64 slot per token."""
    return 4 * tokens * num_kv_heads * head_dim * elem_bytes + 8 * tokens


def rope_and_write_kv_bytes(
    tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, elem_bytes: int
) -> int:
    """Read q, k and v, write the rotated q and the cache's k and v; per token an fp32
    cos/sin row, an int64 position and an int64 slot."""
    moved = 2 * tokens * (num_heads + 2 * num_kv_heads) * head_dim * elem_bytes
    return moved + tokens * (head_dim * 4 + 16)


def w4a16_bytes(m: int, k: int, n: int, group: int, zeros: bool, elem_bytes: int = 2) -> int:
    """A W4A16 product ``[m, k] x [k, n]`` moves the packed weight (half a byte each), the
    fp32 scales and uint8 zero points of its groups, the activations and the output."""
    groups = -(-k // group)
    weight = k * n // 2 + groups * n * (4 + (1 if zeros else 0))
    return weight + (m * k + m * n) * elem_bytes


def copy_bytes(nbytes: int) -> int:
    """A device-to-device copy of ``nbytes`` reads and writes ``nbytes`` each."""
    return 2 * nbytes


def matmul_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def gb_per_s(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def tflop_per_s(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------- results
@dataclass
class Result:
    name: str
    shape: str
    ms: float
    value: float  # GB/s or TFLOP/s
    unit: str
    ceiling_name: str
    ceiling: float  # same unit as value
    target: float  # a fraction of the ceiling, or an absolute value in `unit`
    target_is_fraction: bool
    rel_error: float
    fraction: float = field(init=False)
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.fraction = self.value / self.ceiling if self.ceiling > 0 else 0.0
        reached = self.fraction if self.target_is_fraction else self.value
        self.passed = reached >= self.target and self.rel_error < MAX_REL_ERROR


def make_result(
    name: str, shape: str, ms: float, amount: int, rel_error: float, ceilings: dict[str, float]
) -> Result:
    """``amount`` is bytes for bandwidth-bound kernels, FLOPs for the matmul-bound ones."""
    ceiling_name, target, is_fraction = TARGETS[name]
    if ceiling_name == MATMUL:
        value, unit = tflop_per_s(amount, ms), "TFLOP/s"
    else:
        value, unit = gb_per_s(amount, ms), "GB/s"
    return Result(
        name,
        shape,
        ms,
        value,
        unit,
        ceiling_name,
        ceilings[ceiling_name],
        target,
        is_fraction,
        rel_error,
    )


def format_target(r: Result) -> str:
    if r.target_is_fraction:
        return f">= {r.target:.0%} of {r.ceiling_name}"
    return f">= {r.target:g} {r.unit}"


def format_markdown(meta: dict[str, Any], ceilings: dict[str, float], results: list[Result]) -> str:
    """The results as a Markdown report (header lines, ceilings, one table row per kernel)."""
    lines = [
        "# Kernel benchmarks",
        "",
        f"- GPU: {meta.get('gpu', '?')}",
        f"- torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}",
        f"- date: {meta.get('date', '?')}" + (" (quick run)" if meta.get("quick") else ""),
        "",
        "Ceilings measured in the same run:",
        "",
        f"- copy: {ceilings.get(COPY, 0.0):.1f} GB/s (device-to-device, bytes read + written)",
        f"- matmul: {ceilings.get(MATMUL, 0.0):.1f} TFLOP/s (8192^3 bf16)",
        "",
        "| kernel | shape | time (us) | achieved | ceiling | fraction | target | rel. error "
        "| status |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        status = "pass" if r.passed else "miss"
        if r.rel_error >= MAX_REL_ERROR:
            status = "WRONG"
        lines.append(
            f"| {r.name} | {r.shape} | {r.ms * 1e3:.1f} | {r.value:.1f} {r.unit} "
            f"| {r.ceiling:.1f} {r.unit} ({r.ceiling_name}) | {r.fraction:.1%} "
            f"| {format_target(r)} | {r.rel_error:.1e} | {status} |"
        )
    return "\n".join(lines) + "\n"


SWEEP_MAX_REL_ERROR = 1e-2  # a config further from the reference is wrong, not fast


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """Per layer: the heuristic's decode time, the fastest correct config's and its
    settings (configs whose error exceeds ``SWEEP_MAX_REL_ERROR`` are left out)."""
    lines = ["| layer | M | heuristic (us) | best (us) | best config |", "|---|---:|---:|---:|---|"]
    for layer in dict.fromkeys(r["layer"] for r in rows):
        timed = [
            r
            for r in rows
            if r["layer"] == layer and "us" in r and r.get("zeros", True)
            and r.get("rel_error", 0.0) <= SWEEP_MAX_REL_ERROR
        ]  # fmt: skip
        if not timed:
            continue
        base = next((r for r in timed if r["heuristic"]), None)
        best = min(timed, key=lambda r: r["us"])
        cfg = " ".join(f"{k}={v}" for k, v in best["config"].items())
        base_us = f"{base['us']:.1f}" if base else "n/a"
        lines.append(f"| {layer} | {best['m']} | {base_us} | {best['us']:.1f} | {cfg} |")
    return "\n".join(lines) + "\n"


def to_json(meta: dict[str, Any], ceilings: dict[str, float], results: list[Result]) -> str:
    return json.dumps(
        {"meta": meta, "ceilings": ceilings, "results": [asdict(r) for r in results]}, indent=2
    )


def b_decode_contexts() -> list[int]:
    """The contexts of a B-shaped mixed step's decode rows: ``MIXED_DECODE_ROWS`` seeded
    lengths of 200-1,500 tokens."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(200, 1500, (MIXED_DECODE_ROWS,), generator=g).tolist()


def varlen_batch(
    seq_lens: list[int], q_lens: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A random paged K/V cache (blocks of 16) holding ``seq_lens`` tokens per sequence,
    random q for each one's last ``q_lens`` tokens (``[sum(q_lens), NUM_HEADS, HEAD_DIM]``)
    and their ``query_start_loc`` (int32 ``[B + 1]``)."""
    from kvscale.kernels.testing import random_paged_kv

    kv = random_paged_kv(seq_lens, NUM_KV_HEADS, HEAD_DIM, 16, dtype, device, garbage=None)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    return kv, q, qsl


# --------------------------------------------------------------------------- GPU runs
class Bench:
    def __init__(self, quick: bool) -> None:
        import triton.testing

        self.quick = quick
        self._do_bench = triton.testing.do_bench
        self.device = torch.device("cuda")
        self.dtype = torch.bfloat16

    def time_ms(self, fn: Callable[[], object]) -> float:
        warmup, rep = (5, 20) if self.quick else (25, 200)
        return float(self._do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

    def time_graph_ms(self, fn: Callable[[], object]) -> float:
        """Times ``fn`` replayed from a CUDA graph, as the engine runs decode steps, so
        that launch gaps between a kernel and its reduction pass are not counted."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up / compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.time_ms(graph.replay)

    def copy_gb_per_s(self) -> float:
        nbytes = (256 if self.quick else 1024) << 20
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_(0, 255)
        dst = torch.empty_like(src)
        return gb_per_s(copy_bytes(nbytes), self.time_ms(lambda: dst.copy_(src)))

    def matmul_tflop_per_s(self, n: int = 8192) -> float:
        a = torch.randn(n, n, dtype=self.dtype, device=self.device)
        b = torch.randn(n, n, dtype=self.dtype, device=self.device)
        return tflop_per_s(matmul_flops(n, n, n), self.time_ms(lambda: torch.matmul(a, b)))

    def ceilings(self) -> dict[str, float]:
        return {COPY: self.copy_gb_per_s(), MATMUL: self.matmul_tflop_per_s()}

    def decode(
        self, batch: int, context: int, block_size: int, ceilings: dict[str, float], name: str
    ) -> Result:
        from kvscale.kernels import paged_decode as pd
        from kvscale.kernels.testing import random_paged_kv, rel_error

        kv = random_paged_kv(
            [context] * batch,
            NUM_KV_HEADS,
            HEAD_DIM,
            block_size,
            self.dtype,
            self.device,
            garbage=None,
        )
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=self.dtype, device=self.device)
        out = torch.empty_like(q)
        scale = HEAD_DIM**-0.5
        splits = pd.choose_num_splits(batch, NUM_KV_HEADS, context, pd.num_sms(self.device))

        def run() -> torch.Tensor:
            return pd.paged_decode_attention(
                q,
                kv.k_cache,
                kv.v_cache,
                kv.block_tables,
                kv.seq_lens,
                scale,
                out=out,
                max_seq_len=context,
            )

        err = rel_error(
            run(),
            pd.paged_decode_attention_ref(
                q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale
            ),
        )
        ms = self.time_graph_ms(run)
        nbytes = decode_bytes(batch, context, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2)
        shape = f"B={batch} ctx={context} block={block_size} splits={splits}"
        return make_result(name, shape, ms, nbytes, err, ceilings)

    def prefill(self, num_seqs: int, seq_len: int, ceilings: dict[str, float]) -> Result:
        from kvscale.kernels import paged_prefill as pp
        from kvscale.kernels.testing import random_paged_kv, rel_error

        block_size = 16
        kv = random_paged_kv(
            [seq_len] * num_seqs,
            NUM_KV_HEADS,
            HEAD_DIM,
            block_size,
            self.dtype,
            self.device,
            garbage=None,
        )
        q = torch.randn(
            num_seqs * seq_len, NUM_HEADS, HEAD_DIM, dtype=self.dtype, device=self.device
        )
        qsl = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=self.device) * seq_len
        out = torch.empty_like(q)
        args = (
            q,
            kv.k_cache,
            kv.v_cache,
            qsl,
            kv.seq_lens,
            kv.block_tables,
            seq_len,
            HEAD_DIM**-0.5,
        )

        def run() -> torch.Tensor:
            return pp.paged_prefill_attention(*args, out=out)

        err = rel_error(run(), pp.paged_prefill_attention_ref(*args))
        ms = self.time_ms(run)
        flops = prefill_flops([seq_len] * num_seqs, NUM_HEADS, HEAD_DIM)
        shape = f"{num_seqs} seqs x {seq_len} tokens, causal, block={block_size}"
        return make_result("paged_prefill", shape, ms, flops, err, ceilings)

    def prefill_mixed(self, ceilings: dict[str, float]) -> list[Result]:
        """A mixed step shaped like workload B's: ``MIXED_DECODE_ROWS`` decode rows
        (``b_decode_contexts``) and one ``MIXED_PROMPT``-token prompt, with the short
        sequences in their own small tiles (the default) and all in one launch of the
        large ones; bytes: every sequence's K/V read once, q read and out written."""
        from kvscale.kernels import paged_prefill as pp
        from kvscale.kernels.testing import rel_error

        ctx = b_decode_contexts()
        seq_lens, q_lens = [*ctx, MIXED_PROMPT], [1] * len(ctx) + [MIXED_PROMPT]
        kv, q, qsl = varlen_batch(seq_lens, q_lens, self.dtype, self.device)
        t = q.shape[0]
        args = (q, kv.k_cache, kv.v_cache, qsl, kv.seq_lens, kv.block_tables, MIXED_PROMPT)
        ref = pp.paged_prefill_attention_ref(*args, HEAD_DIM**-0.5)
        nbytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * t * NUM_HEADS * HEAD_DIM * 2
        shape = f"{MIXED_DECODE_ROWS} decode rows (ctx 200-1500) + a {MIXED_PROMPT}-token prompt"
        results = []
        for name, short in (("paged_prefill_mixed", pp.SHORT_QUERY),
                            ("paged_prefill_mixed_one_launch", 0)):  # fmt: skip
            out = torch.empty_like(q)

            def run(short: int = short, out: torch.Tensor = out) -> torch.Tensor:
                return pp.paged_prefill_attention(*args, HEAD_DIM**-0.5, out=out, short_query=short)

            err = rel_error(run(), ref)
            results.append(make_result(name, shape, self.time_ms(run), nbytes, err, ceilings))
        return results

    def elementwise(self, ceilings: dict[str, float]) -> list[Result]:
        from kvscale.kernels import activation, kv_cache, rmsnorm, rope_kv_cache, rotary
        from kvscale.kernels.testing import rel_error

        t, dev, dtype = ELEMENTWISE_TOKENS, self.device, self.dtype
        results = []

        x = torch.randn(t, HIDDEN, dtype=dtype, device=dev)
        w = torch.randn(HIDDEN, dtype=dtype, device=dev)
        err = rel_error(rmsnorm.rms_norm(x, w, 1e-5), rmsnorm.rms_norm_ref(x, w, 1e-5))
        ms = self.time_ms(lambda: rmsnorm.rms_norm(x, w, 1e-5))
        results.append(
            make_result(
                "rms_norm", f"T={t} H={HIDDEN}", ms, rms_norm_bytes(t, HIDDEN, 2), err, ceilings
            )
        )

        res = torch.randn_like(x)
        xk, rk, xr, rr = x.clone(), res.clone(), x.clone(), res.clone()
        rmsnorm.fused_add_rms_norm(xk, rk, w, 1e-5)
        rmsnorm.fused_add_rms_norm_ref(xr, rr, w, 1e-5)
        err = max(rel_error(xk, xr), rel_error(rk, rr))
        ms = self.time_ms(lambda: rmsnorm.fused_add_rms_norm(xk, rk, w, 1e-5))
        results.append(
            make_result(
                "fused_add_rms_norm",
                f"T={t} H={HIDDEN}",
                ms,
                fused_add_rms_norm_bytes(t, HIDDEN, 2),
                err,
                ceilings,
            )
        )

        cache = rotary.compute_cos_sin_cache(HEAD_DIM, 131072, ROPE_THETA, ROPE_SCALING).to(dev)
        pos = torch.randint(0, 131072, (t,), device=dev)
        q = torch.randn(t, NUM_HEADS, HEAD_DIM, dtype=dtype, device=dev)
        k = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
        qk, kk, qr, kr = q.clone(), k.clone(), q.clone(), k.clone()
        rotary.rotary_embedding(pos, qk, kk, cache)
        rotary.rotary_embedding_ref(pos, qr, kr, cache)
        err = max(rel_error(qk, qr), rel_error(kk, kr))
        ms = self.time_ms(lambda: rotary.rotary_embedding(pos, q, k, cache))
        results.append(
            make_result(
                "rotary_embedding",
                f"T={t} Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM}",
                ms,
                rotary_bytes(t, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2),
                err,
                ceilings,
            )
        )

        g = torch.randn(t, 2 * INTERMEDIATE, dtype=dtype, device=dev)
        err = rel_error(activation.silu_and_mul(g), activation.silu_and_mul_ref(g))
        ms = self.time_ms(lambda: activation.silu_and_mul(g))
        results.append(
            make_result(
                "silu_and_mul",
                f"T={t} I={INTERMEDIATE}",
                ms,
                silu_and_mul_bytes(t, INTERMEDIATE, 2),
                err,
                ceilings,
            )
        )

        block_size = 16
        num_blocks = 2 * t // block_size
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        kc = torch.randn(shape, dtype=dtype, device=dev)
        vc = torch.randn_like(kc)
        kn = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=dev)
        vn = torch.randn_like(kn)
        blocks = torch.randperm(num_blocks, device=dev)[: t // block_size]
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=dev)).flatten()
        kc2, vc2 = kc.clone(), vc.clone()
        kv_cache.write_kv_cache(kn, vn, kc, vc, slots)
        kv_cache.write_kv_cache_ref(kn, vn, kc2, vc2, slots)
        err = max(rel_error(kc, kc2), rel_error(vc, vc2))
        ms = self.time_ms(lambda: kv_cache.write_kv_cache(kn, vn, kc, vc, slots))
        results.append(
            make_result(
                "write_kv_cache",
                f"T={t} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={block_size}",
                ms,
                write_kv_cache_bytes(t, NUM_KV_HEADS, HEAD_DIM, 2),
                err,
                ceilings,
            )
        )

        # the two above in one launch (what the Triton attention backend runs)
        kc2, vc2 = kc.clone(), vc.clone()
        qf = rope_kv_cache.rope_and_write_kv(pos, q, kn, vn, cache, kc, vc, slots)
        qr = rope_kv_cache.rope_and_write_kv_ref(pos, q, kn, vn, cache, kc2, vc2, slots)
        err = max(rel_error(qf, qr), rel_error(kc, kc2), rel_error(vc, vc2))
        ms = self.time_ms(
            lambda: rope_kv_cache.rope_and_write_kv(pos, q, kn, vn, cache, kc, vc, slots)
        )
        results.append(
            make_result(
                "rope_and_write_kv",
                f"T={t} Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={block_size}",
                ms,
                rope_and_write_kv_bytes(t, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 2),
                err,
                ceilings,
            )
        )
        return results

    # ---- W4A16 ---------------------------------------------------------------------------
    def _w4a16_operands(self, m: int, k: int, n: int) -> dict[str, Any]:
        g = -(-k // W4A16_GROUP)
        dev = self.device
        return {
            "x": torch.randn(m, k, dtype=self.dtype, device=dev),
            "qweight": torch.randint(
                -(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev
            ),
            "scales": torch.rand(g, n, device=dev) * 0.01 + 1e-3,
            "zeros": torch.randint(0, 16, (g, n), dtype=torch.uint8, device=dev),
        }

    def w4a16(self, layer: str, m: int, k: int, n: int, ceilings: dict[str, float]) -> Result:
        from kvscale.kernels import w4a16
        from kvscale.kernels.testing import rel_error

        ops = self._w4a16_operands(m, k, n)
        x, qw, s, z = ops["x"], ops["qweight"], ops["scales"], ops["zeros"]

        def run() -> torch.Tensor:
            return w4a16.w4a16_gemm(x, qw, s, z, W4A16_GROUP)

        err = rel_error(run(), w4a16.w4a16_gemm_ref(x, qw, s, z, W4A16_GROUP))
        dense = w4a16.dequantize_w4(qw, s, z, W4A16_GROUP, k).to(self.dtype)
        decode = m <= max(W4A16_DECODE_M)
        timer = self.time_graph_ms if decode else self.time_ms
        ms = timer(run)
        bf16_ms = timer(lambda: torch.matmul(x, dense))
        cfg = w4a16.w4a16_config(m, n, k, self.device)
        shape = (
            f"{layer} M={m} K={k} N={n} g={W4A16_GROUP} {'GEMV ' if cfg.get('GEMV') else ''}"
            f"BM={cfg['BLOCK_M']} "
            f"BN={cfg['BLOCK_N']} BK={cfg['BLOCK_K']} split={cfg['SPLIT_K']}; "
            f"bf16 matmul {bf16_ms * 1e3:.1f} us ({bf16_ms / ms:.2f}x)"
        )
        if decode:
            amount = w4a16_bytes(m, k, n, W4A16_GROUP, zeros=True)
            return make_result("w4a16_decode", shape, ms, amount, err, ceilings)
        return make_result("w4a16_prefill", shape, ms, matmul_flops(m, n, k), err, ceilings)

    def w4a16_sweep(
        self, layer: str, m: int, k: int, n: int, ceilings: dict[str, float]
    ) -> list[dict[str, Any]]:
        """Graph-timed decode configs around the heuristic's: which wins, by how much
        (each config's error against the reference beside it)."""
        from kvscale.kernels import w4a16
        from kvscale.kernels.testing import rel_error

        ops = self._w4a16_operands(m, k, n)
        x, qw, s, z = ops["x"], ops["qweight"], ops["scales"], ops["zeros"]
        base = w4a16.w4a16_config(m, n, k, self.device)
        # (config, its K tiles a program (GEMV sweep), timed without zero points (GPTQ's
        # layout)): the heuristic's, the same with split-K summed by a second kernel
        # (FIXUP 0), the tl.dot kernel's heuristic (for one row: what GEMV replaced), then
        # the sweep's tiles with the heuristic's kernel (for one row: K tiles a program)
        configs: list[tuple[dict[str, int], int, bool]] = [
            (dict(base), 0, False),
            (dict(base, FIXUP=0), 0, False),
            (w4a16.w4a16_config(m, n, k, self.device, gemv_block_k=None), 0, False),
        ]
        gemv = bool(base.get("GEMV"))
        if gemv:
            for bn, bk, warps, stages in W4A16_GEMV_SWEEP:
                for tiles in W4A16_GEMV_TILES:
                    split = max(1, -(-k // (bk * tiles)))
                    cfg = dict(GEMV=1, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                               num_warps=warps, num_stages=stages)  # fmt: skip
                    configs.append((cfg, tiles, False))
            # the default GEMV in 128- and 64-row K tiles without zero points (r26: GPTQ's
            # int4 C fell behind AWQ's after the 128-row tiles, NOTES e39)
            for block_k in (128, 64):
                cfg = w4a16.w4a16_config(m, n, k, self.device, gemv_block_k=block_k)
                configs.append((cfg, 0, True))
        else:
            splits = {base["SPLIT_K"], max(1, base["SPLIT_K"] // 2), 2 * base["SPLIT_K"]}
            for bn, bk, warps, stages in W4A16_SWEEP:
                for split in sorted(splits):
                    cfg = dict(BLOCK_M=base["BLOCK_M"], BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                               num_warps=warps, num_stages=stages)  # fmt: skip
                    configs.append((cfg, 0, False))
        rows = []
        nbytes = w4a16_bytes(m, k, n, W4A16_GROUP, zeros=True)
        ref = w4a16.w4a16_gemm_ref(x, qw, s, z, W4A16_GROUP)
        ref_sym = w4a16.w4a16_gemm_ref(x, qw, s, None, W4A16_GROUP) if gemv else None
        for i, (cfg, tiles, symmetric) in enumerate(configs):
            zeros, want = (None, ref_sym) if symmetric else (z, ref)
            try:
                err = rel_error(w4a16.w4a16_gemm(x, qw, s, zeros, W4A16_GROUP, config=cfg), want)
                ms = self.time_graph_ms(
                    lambda cfg=cfg, zeros=zeros: w4a16.w4a16_gemm(
                        x, qw, s, zeros, W4A16_GROUP, config=cfg
                    )
                )
            except Exception as e:  # a config that does not compile (shared memory)
                rows.append({"layer": layer, "m": m, "config": cfg, "error": repr(e)[:200]})
                continue
            rows.append(
                {
                    "layer": layer,
                    "m": m,
                    "config": cfg,
                    "heuristic": i == 0,
                    "zeros": not symmetric,
                    "tiles": tiles,
                    "rel_error": err,
                    "us": ms * 1e3,
                    "gb_per_s": gb_per_s(nbytes, ms),
                    "fraction_of_copy": gb_per_s(nbytes, ms) / ceilings[COPY],
                }
            )
        return rows


def w4a16_cases(
    bench: Bench, ceilings: dict[str, float], sweep: bool
) -> tuple[list[Result], list[dict[str, Any]]]:
    """The W4A16 GEMM at each 8B layer shape: decode batches (1 and 16 rows, graph-timed)
    and a 4,096-token prefill, with the bf16 ``torch.matmul`` of the same shape for
    comparison; ``sweep`` also times alternative decode configs (returned as rows)."""
    results: list[Result] = []
    rows: list[dict[str, Any]] = []
    for layer, k, n in W4A16_LAYERS:
        for m in (*W4A16_DECODE_M, W4A16_PREFILL_M):
            results.append(bench.w4a16(layer, m, k, n, ceilings))
            if sweep and m == 1:
                rows += bench.w4a16_sweep(layer, m, k, n, ceilings)
            torch.cuda.empty_cache()
    return results, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="fewer timing repetitions")
    parser.add_argument(
        "--only", default="", help="comma list of groups to run: attention, elementwise, w4a16"
    )
    parser.add_argument(
        "--w4a16-sweep", action="store_true", help="also time alternative W4A16 decode configs"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    bench = Bench(args.quick)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
    }
    ceilings = bench.ceilings()
    print(f"copy {ceilings[COPY]:.1f} GB/s, matmul {ceilings[MATMUL]:.1f} TFLOP/s", flush=True)
    results: list[Result] = []
    sweep: list[dict[str, Any]] = []

    def w4a16_group() -> list[Result]:
        found, rows = w4a16_cases(bench, ceilings, args.w4a16_sweep)
        sweep.extend(rows)
        return found

    groups: dict[str, list[Callable[[], list[Result]]]] = {
        "attention": [
            lambda: [bench.decode(64, 4096, 16, ceilings, "paged_decode")],
            lambda: [bench.decode(1, 32768, 16, ceilings, "paged_decode_split")],
            lambda: [bench.prefill(8, 2048, ceilings)],
            lambda: bench.prefill_mixed(ceilings),
        ],
        "elementwise": [lambda: bench.elementwise(ceilings)],
        "w4a16": [w4a16_group],
    }
    chosen = [g for g in args.only.split(",") if g] or list(groups)
    unknown = set(chosen) - set(groups)
    if unknown:
        parser.error(f"--only: unknown groups {sorted(unknown)}; known: {', '.join(groups)}")
    cases = [case for g in chosen for case in groups[g]]
    for case in cases:
        for r in case():
            results.append(r)
            print(
                f"{r.name:20s} {r.value:9.1f} {r.unit:8s} {r.fraction:6.1%} of {r.ceiling_name}"
                f"  target {format_target(r)}  rel.err {r.rel_error:.1e}"
                f"  {'pass' if r.passed else 'miss'}",
                flush=True,
            )
        torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "kernels.json").write_text(to_json(meta, ceilings, results) + "\n")
    (args.out_dir / "kernels.md").write_text(format_markdown(meta, ceilings, results))
    print(f"wrote {args.out_dir / 'kernels.json'} and {args.out_dir / 'kernels.md'}")
    if sweep:
        (args.out_dir / "w4a16_sweep.json").write_text(
            json.dumps({"meta": meta, "ceilings": ceilings, "rows": sweep}, indent=2) + "\n"
        )
        print(format_sweep(sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
