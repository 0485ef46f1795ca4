"""bf16 GEMMs at a few rows, as a decode step runs them: which call shape cuBLAS serves best.

C's decode step (batch 1) spends 5.5 ms in the layers' GEMMs, which move their weights at
2.4-2.9 TB/s: qkv_proj and o_proj (50 and 34 MB) at ~2.4, o_proj and down_proj with a
split-K reduction kernel after them (NOTES e15, e40). cuBLAS picks its kernel from the
call's shape, so the same product asked for differently may get another one. Per 8B
layer and row count, each variant's time per call from CUDA-graph replays that cycle
through enough copies of the weight (over 4x the L2) that every call reads it from
memory, as in a step; the kernels each call launches (torch.profiler); and the bytes'
rate against the copy bandwidth measured here:

- ``linear``: ``F.linear(x, w)``, the dense linear method's call (``x @ w.T``);
- ``mv``: ``torch.mv(w, x[0])`` (one row);
- ``w_x``: ``(w @ x.T).T``, the transposed product (cuBLAS sees N rows and M columns);
- ``splitS``: split-K by the caller, ``torch.bmm`` over S strided K-slices of the same
  ``w`` (no copy), giving S partial products ``[S, M, N]`` that the next kernel would sum
  (timed without the sum); ``splitS+sum`` adds the sum as its own kernel; ``splitSf``
  the partials in fp32 (``torch.bmm(..., out_dtype=torch.float32)``).

``--shapes tp2`` times the per-rank shapes at two-way tensor parallelism (qkv and
gate_up with half the outputs, o and down with half the inputs, the head half the vocabulary).

    python bench/gemm_rows.py [--out-dir DIR] [--rows 1,4] [--variants ...] [--shapes 8b|tp2]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvscale.kernels.testing import LLAMA_8B_LINEARS
from kvscale.server.quantization.dense import BLAS_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_trace  # bench/ is not a package

HIDDEN, VOCAB = 4096, 128256
LAYERS = (  # (name, N, K) of the 8B model's GEMMs: y[M, N] = x[M, K] @ w[N, K].T
    *((name, n, k) for name, k, n in LLAMA_8B_LINEARS),
    ("head", VOCAB, HIDDEN),
)
L2_MULTIPLE = 4  # the copies a graph cycles through hold this many times the L2
REPLAYS = 30

Variant = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_k_partials(
    x: torch.Tensor, w: torch.Tensor, splits: int, fp32: bool = False
) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` as ``splits`` partial products ``[splits, M, N]`` (one
    batched GEMM over strided views of K's slices: nothing is copied); ``fp32``: the
    partials in fp32 (``out_dtype``), else in ``x``'s dtype."""
    m, k = x.shape
    n = w.shape[0]
    xs = x.view(m, splits, k // splits).transpose(0, 1)
    ws = w.view(n, splits, k // splits).permute(1, 2, 0)
    if not fp32:
        return torch.bmm(xs, ws)
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())  # (no out_dtype on the CPU: for the tests)


def _split(s: int, summed: bool, fp32: bool = False) -> Variant:
    if summed:
        return lambda x, w: split_k_partials(x, w, s, fp32).sum(0)
    return lambda x, w: split_k_partials(x, w, s, fp32)


VARIANTS: dict[str, Variant] = {
    "linear": lambda x, w: F.linear(x, w),
    "mv": lambda x, w: torch.mv(w, x[0]).unsqueeze(0),
    "w_x": lambda x, w: (w @ x.t()).t(),
    **{f"split{s}": _split(s, False) for s in (2, 3, 4, 8)},
    **{f"split{s}+sum": _split(s, True) for s in (2, 4)},
    **{f"split{s}f": _split(s, False, fp32=True) for s in (2, 4)},
}


def applies(variant: str, rows: int, k: int) -> bool:
    if variant.startswith("split"):
        return k % int(variant[5:].split("+")[0].rstrip("f")) == 0
    return variant != "mv" or rows == 1


def shapes(which: str) -> list[tuple[str, int, int]]:
    """(name, N, K) per rank: the 8B model's, or its per-rank shapes at TP=2."""
    if which == "8b":
        return list(LAYERS)
    half_out = {"qkv", "gate_up", "head"}
    return [(name, n // 2, k) if name in half_out else (name, n, k // 2) for name, n, k in LAYERS]


def result(y: torch.Tensor) -> torch.Tensor:
    """A variant's ``[M, N]`` result in fp32 (partials summed)."""
    return y.float().sum(0) if y.dim() == 3 else y.float()


def copies_for(nbytes: int, l2_bytes: int) -> int:
    """Weight copies a graph cycles through so that none is still in L2 when read again."""
    return max(2, -(-L2_MULTIPLE * l2_bytes // nbytes))


def time_variant(fn: Variant, x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, float]:
    """Median us per call over ``REPLAYS`` replays of a graph calling ``fn`` once per copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(x, w)  # warm-up outside the capture (cuBLAS handles, workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / len(weights))
    return {"us": statistics.median(times), "min_us": min(times)}


def kernels_of(fn: Variant, x: torch.Tensor, w: torch.Tensor) -> list[str]:
    """The CUDA kernels one eager call launches, by name and launch grid
    (``kernel_trace.label``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x, w)
        torch.cuda.synchronize()
    return [name for name, _ in kernel_trace.cuda_kernels(prof)]


def copy_gb_per_s() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def run_meta(**extra: Any) -> dict[str, Any]:
    """The GPU, torch, the date, the copy bandwidth measured now and the L2's size, with
    ``extra``; printed as one JSON line. Exits without a CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    meta = {
        "gpu": props.name,
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "copy_gb_per_s": copy_gb_per_s(),
        "l2_bytes": props.L2_cache_size,
        "blas_backend": str(torch.backends.cuda.preferred_blas_library()),
        "blas_env": {k: os.environ[k] for k in BLAS_ENV if k in os.environ},
        **extra,
    }
    print(json.dumps(meta), flush=True)
    return meta


def write_results(out_dir: Path, name: str, meta: dict[str, Any], results: Any) -> Path:
    """``{"meta": meta, "results": results}`` as ``out_dir/name`` (indented JSON); says
    where."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", choices=("8b", "tp2"), default="8b")
    args = ap.parse_args(argv)
    meta = run_meta(shapes=args.shapes)
    props, copy = torch.cuda.get_device_properties(0), meta["copy_gb_per_s"]
    rows_out = []
    chosen = args.variants.split(",")
    for name, n, k in shapes(args.shapes):
        nbytes = n * k * 2
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            for _ in range(copies_for(nbytes, props.L2_cache_size))
        ]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ weights[0].float().t()
            for variant in chosen:
                fn = VARIANTS[variant]
                if not applies(variant, m, k):
                    continue
                err = ((result(fn(x, weights[0])) - ref).norm() / ref.norm()).item()
                t = time_variant(fn, x, weights)
                row = {"layer": name, "m": m, "variant": variant, **t, "rel_error": err,
                       "gb_per_s": nbytes / (t["us"] / 1e6) / 1e9,
                       "kernels": kernels_of(fn, x, weights[0])}  # fmt: skip
                row["fraction_of_copy"] = row["gb_per_s"] / copy
                rows_out.append(row)
                print(
                    f"{name:8s} M={m:<3d} {variant:11s} {t['us']:8.1f} us "
                    f"{row['gb_per_s']:7.0f} GB/s ({row['fraction_of_copy']:.0%} of copy) "
                    f"err {err:.1e}  {' + '.join(row['kernels'])}",
                    flush=True,
                )
        del weights
        torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "gemm_rows.json" if args.shapes == "8b" else f"gemm_rows_{args.shapes}.json"
    (args.out_dir / name).write_text(json.dumps({"meta": meta, "rows": rows_out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
