"""Host time to launch our elementwise Triton kernels three ways (NOTES e70).

An eager step launches each kernel through its Python wrapper (shape checks, the output's
allocation, then ``kernel[grid](...)``, i.e. Triton's ``JITFunction.run``: binding the
arguments, computing the specialization key, finding the compiled kernel). e70's plan is
to call the compiled kernel's launcher directly where the wrapper already knows the key.
Before writing it, this measures what it could save on the GPU host: per kernel, at the
8B model's sizes, the host time a call of

- ``wrapper``: the wrapper, as an eager step calls it;
- ``jit``: ``kernel[grid](...)`` alone, its arguments prepared once;
- ``direct``: the compiled kernel's ``run`` with the bound arguments (what JITFunction.run
  ends with), after checking that it writes what ``jit`` writes.

A sleep kernel keeps the GPU busy, so no call waits for it (``blas_host_cost``'s method).

    python bench/triton_launch_cost.py [--out-dir DIR] [--rows 64] [--calls 200]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blas_host_cost import gpu_busy_and_sync, host_us_per_call  # bench/ is not a package
from gemm_rows import run_meta, write_results

HIDDEN, INTER = 4096, 14336  # the 8B model's


def bound_values(jit_fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The kernel's parameters in order, defaults applied (``JITFunction.run``'s
    ``bound_args.values()``); launch options such as ``num_warps`` are not parameters."""
    sig = inspect.signature(jit_fn.fn)
    params = {k: v for k, v in kwargs.items() if k in sig.parameters}
    bound = sig.bind(*args, **params)
    bound.apply_defaults()
    return list(bound.arguments.values())


def direct_launch(
    jit_fn: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Callable[[], None]:
    """A call of the compiled kernel's launcher with these arguments (compiled and run once
    through ``jit_fn[grid]`` first)."""
    compiled = jit_fn[grid](*args, **kwargs)
    values = bound_values(jit_fn, args, kwargs)
    g = (*grid, 1, 1)[:3]
    stream = torch.cuda.current_stream().cuda_stream
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata

    def call() -> None:
        run(g[0], g[1], g[2], stream, function, packed, None, None, None, *values)

    return call


def cases(device: torch.device, rows: int) -> list[dict[str, Any]]:
    """Per kernel: its wrapper call, its JIT function, grid, arguments and output."""
    import triton

    from kvscale.kernels import activation, rmsnorm
    from kvscale.kernels.rmsnorm import row_launch_opts

    dt = torch.bfloat16
    x = torch.randn(rows, HIDDEN, device=device, dtype=dt)
    res = torch.randn(rows, HIDDEN, device=device, dtype=dt)
    w = torch.randn(HIDDEN, device=device, dtype=dt)
    out = torch.empty_like(x)
    gu = torch.randn(rows, 2 * INTER, device=device, dtype=dt)
    act = torch.empty(rows, INTER, device=device, dtype=dt)
    block = min(1024, triton.next_power_of_2(INTER))
    return [
        {
            "kernel": "rms_norm",
            "wrapper": lambda: rmsnorm.rms_norm(x, w, 1e-5),
            "jit": rmsnorm._rms_norm_kernel,
            "grid": (rows,),
            "args": (x, w, out, rows, HIDDEN, 1e-5, x.stride(0), out.stride(0)),
            "kwargs": row_launch_opts(HIDDEN),
            "out": out,
        },
        {
            "kernel": "silu_and_mul",
            "wrapper": lambda: activation.silu_and_mul(gu),
            "jit": activation._silu_and_mul_kernel,
            "grid": (rows, -(-INTER // block)),
            "args": (gu, act, rows, INTER, gu.stride(0), act.stride(0)),
            "kwargs": {"BLOCK": block, "num_warps": 4},
            "out": act,
        },
        {
            "kernel": "fused_add_rms_norm",
            "wrapper": lambda: rmsnorm.fused_add_rms_norm(out, res, w, 1e-5),
            "jit": None,  # in place, so repeated launches differ: its wrapper alone
            "out": None,
        },
    ]


def measure(device: torch.device, rows: int, calls: int) -> list[dict[str, Any]]:
    """One row per kernel: host us a call of its wrapper, ``jit`` and ``direct`` (or the
    error the direct launch raised on this Triton), and whether ``direct`` wrote the same."""
    busy, sync = gpu_busy_and_sync(device)
    results = []
    for case in cases(device, rows):
        row: dict[str, Any] = {"kernel": case["kernel"], "rows": rows}
        case["wrapper"]()
        row["wrapper_us"] = host_us_per_call(case["wrapper"], calls, busy, sync)
        if case["jit"] is not None:
            fn, grid, args, kw = case["jit"], case["grid"], case["args"], case["kwargs"]
            row["jit_us"] = host_us_per_call(partial(fn[grid], *args, **kw), calls, busy, sync)
            try:
                direct = direct_launch(fn, grid, args, kw)
                want = case["out"].clone()
                case["out"].zero_()
                direct()
                sync()
                row["direct_equal"] = bool(torch.equal(case["out"], want))
                row["direct_us"] = host_us_per_call(direct, calls, busy, sync)
            except Exception as e:  # the launcher's arguments differ between Triton versions
                row["direct_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    meta = run_meta()
    results = measure(torch.device("cuda"), args.rows, args.calls)
    write_results(args.out_dir, "triton_launch_cost.json", meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
