"""The FP8 GEMM's own rate against the bf16 matmul, at the 8B model's linear layers.

Issue 23's FP8 target is A >= 1.4x bf16; r5/e13 measured 1.18x with FP8 weights. A's
prefill steps (8,192 rows) are about half of its time and compute-bound, so the GEMM's
rate there bounds what FP8 can give. Per layer and row count (1, 256, 8,192), timed from a
CUDA graph (median), TFLOP/s and the ratio to bf16 for:

- ``bf16``: ``F.linear`` on bf16 weights (the dense layers);
- ``rowwise``: ``torch._scaled_mm`` with per-token x per-channel scales, as
  ``server/quantization/fp8.py`` runs it on CUDA (the activations' quantization kernel,
  ``kernels/fp8.py``, included);
- ``rowwise-fast``: the same with ``use_fast_accum=True``;
- ``rowwise-gemm`` / ``rowwise-gemm-fast``: the GEMM alone, on activations quantized
  once beforehand;
- ``tensor-gemm`` / ``tensor-gemm-fast``: the GEMM alone with one scale per operand (a
  static-scale checkpoint's);
- ``quantize``: the quantization kernel alone.

Lease r22 ran an earlier version that left the operators on their torch references
(``ops.use_kernels`` was not called): its ``rowwise`` and ``quantize`` lines timed torch's
quantization, not the kernel's.

Each line's ``err`` is the relative error against the fp32 product of the row-wise
quantized operands, dequantized: for the ``-fast`` lines what fast accumulation costs at
K = 4,096 and 14,336; the ``tensor`` lines quantize coarser, and their error says so.

    python bench/fp8_mm.py [--out-dir DIR] [--rows 1,256,8192]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from kvscale.kernels.fp8 import FP8_E4M3 as FP8
from kvscale.kernels.fp8 import FP8_MAX
from kvscale.kernels.testing import rel_error
from kvscale.server.quantization.fp8 import quantize_rows


def bench_kernels() -> ModuleType:
    """``bench/kernels.py`` (its graph timer and the 8B layer shapes; bench/ is not a
    package: loaded by path)."""
    import importlib.util
    import sys

    path = Path(__file__).with_name("kernels.py")
    spec = importlib.util.spec_from_file_location("kvscale_bench_kernels", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def variants(
    x: torch.Tensor, w: torch.Tensor
) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """The products to time for ``x [M, K]`` bf16 and ``w [N, K]`` bf16, and their fp32
    reference (the row-wise quantized operands, dequantized). The operators run as the
    engine runs them on CUDA (``ops.use_kernels(True)``: the caller's)."""
    from kvscale.server.layers import ops

    wq, ws = quantize_rows(w)  # per output channel: ws [N, 1]
    wt, ws_row = wq.t(), ws.view(1, -1)
    w_scale = ws.max().reshape(())
    wq_t = (w.float() / w_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).t()
    xq, xs = ops.fp8_quantize_groups(x, x.shape[-1])
    ref = (xq.float() * xs) @ (wq.float() * ws).t()
    x_scale = (x.float().abs().amax() / FP8_MAX).reshape(())
    xq_t = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    w_scale_t = w_scale * torch.ones((), device=x.device)

    def rowwise(fast: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            q, s = ops.fp8_quantize_groups(x, x.shape[-1])
            return torch._scaled_mm(
                q, wt, scale_a=s, scale_b=ws_row, out_dtype=x.dtype, use_fast_accum=fast
            )

        return run

    def gemm(
        a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, fast: bool
    ) -> Callable[[], torch.Tensor]:
        return lambda: torch._scaled_mm(
            a, b, scale_a=sa, scale_b=sb, out_dtype=x.dtype, use_fast_accum=fast
        )

    return {
        "bf16": lambda: F.linear(x, w),
        "rowwise": rowwise(False),
        "rowwise-fast": rowwise(True),
        "rowwise-gemm": gemm(xq, wt, xs, ws_row, False),
        "rowwise-gemm-fast": gemm(xq, wt, xs, ws_row, True),
        "tensor-gemm": gemm(xq_t, wq_t, x_scale, w_scale_t, False),
        "tensor-gemm-fast": gemm(xq_t, wq_t, x_scale, w_scale_t, True),
        "quantize": lambda: ops.fp8_quantize_groups(x, x.shape[-1])[0],
    }, ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,256,8192")
    args = ap.parse_args()
    from kvscale.server.layers import ops

    ops.use_kernels(True)  # the Triton kernels, as the engine routes them on CUDA
    torch.manual_seed(0)
    dev = torch.device("cuda")
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    print(meta, flush=True)
    kernels = bench_kernels()
    time_graph_ms = kernels.Bench(quick=False).time_graph_ms
    rows = []
    for m in (int(v) for v in args.rows.split(",")):
        for layer, k, n in kernels.W4A16_LAYERS:  # the 8B model's linear layers
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
            runs, ref = variants(x, w)
            base = None
            for name, fn in runs.items():
                try:
                    ms = time_graph_ms(fn)
                    err = rel_error(fn(), ref) if name != "quantize" else 0.0
                except Exception as e:  # a variant this torch does not run
                    rows.append({"m": m, "layer": layer, "variant": name, "error": repr(e)[:300]})
                    print(f"M={m:5d} {layer:8s} {name:13s} error {e!r:.200}", flush=True)
                    continue
                tflops = 2 * m * n * k / (ms * 1e-3) / 1e12
                base = ms if name == "bf16" else base
                speedup = base / ms if base else float("nan")
                rows.append(
                    {"m": m, "layer": layer, "variant": name, "us": ms * 1e3, "tflops": tflops,
                     "vs_bf16": speedup, "rel_error": err}
                )  # fmt: skip
                print(
                    f"M={m:5d} {layer:8s} {name:13s} {ms * 1e3:9.1f} us {tflops:7.1f} TFLOP/s "
                    f"{speedup:5.2f}x bf16  err {err:.1e}",
                    flush=True,
                )
            del x, w, runs, ref
            torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "fp8_mm.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
