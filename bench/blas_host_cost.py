"""Host time to enqueue one bf16 GEMM (``F.linear``) under cuBLAS and under cuBLASLt.

r78 (NOTES e66 measured): with cuBLASLt for every GEMM, B's eager mixed steps took 1.0-3.2
ms longer and as much more host time, ~15-30 us a GEMM call by arithmetic. The guess:
PyTorch asks cuBLASLt's heuristic for an algorithm on every call, while cuBLAS's choice
is cheaper. This measures the host side alone: a long sleep kernel keeps the GPU busy, so
no call waits for it, then ``--calls`` calls of one 8B layer at one row count are
enqueued back to back; host time a call = wall time / calls (the median of ``REPEATS``).
Each library and shape is called once first (workspaces, handles, heuristics' caches).

    python bench/blas_host_cost.py [--out-dir DIR] [--rows 1,64,512] [--calls 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvscale.kernels.testing import LLAMA_8B_LINEARS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_rows import run_meta, write_results  # bench/ is not a package

LIBRARIES = ("cublas", "cublaslt")
REPEATS = 5
SLEEP_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: longer than any repeat's enqueueing


def host_us_per_call(
    call: Callable[[], object], calls: int, busy: Callable[[], None], sync: Callable[[], None]
) -> float:
    """Median over ``REPEATS`` of the host's time (us) to issue one ``call()``: ``busy``
    before each repeat (on a GPU: a kernel that outlasts it), ``sync`` after it, untimed
    (so launches never pile up to the driver's queue limit, which would block)."""
    times = []
    for _ in range(REPEATS):
        busy()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(times)


def gpu_busy_and_sync(device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """``busy`` (a sleep kernel longer than any repeat's enqueueing) and ``sync`` for
    :func:`host_us_per_call` on ``device``; both do nothing on the CPU."""
    cuda = device.type == "cuda"

    def busy() -> None:
        if cuda:
            torch.cuda._sleep(SLEEP_CYCLES)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    return busy, sync


def measure(
    device: torch.device, rows: list[int], libraries: list[str], calls: int, scale: int = 1
) -> list[dict[str, Any]]:
    """One row per (library, layer, row count): host us a call. ``scale`` divides the
    layers' sizes (CPU tests); on the CPU ``libraries`` must be ``["default"]``."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    busy, sync = gpu_busy_and_sync(device)
    out = []
    for lib in libraries:
        if lib != "default":
            torch.backends.cuda.preferred_blas_library(lib)
        for name, k, n in LLAMA_8B_LINEARS:
            w = torch.randn(n // scale, k // scale, device=device, dtype=dtype)
            for m in rows:
                x = torch.randn(m, k // scale, device=device, dtype=dtype)
                F.linear(x, w)  # first call: handles, workspace, heuristics
                us = host_us_per_call(partial(F.linear, x, w), calls, busy, sync)
                out.append({"library": lib, "layer": name, "rows": m, "host_us": us})
                print(f"{lib:>9} {name:>8} {m:>4} rows: {us:7.1f} us a call", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,64,512")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--libraries", default=",".join(LIBRARIES))
    args = ap.parse_args(argv)
    meta = run_meta()
    results = measure(
        torch.device("cuda"),
        [int(r) for r in args.rows.split(",")],
        args.libraries.split(","),
        args.calls,
    )
    write_results(args.out_dir, "blas_host_cost.json", meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
