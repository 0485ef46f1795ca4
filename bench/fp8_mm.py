"""The FP8 GEMM's own rate against the bf16 matmul, at the 8B model's linear layers.

Issue 23's FP8 target is A >= 1.4x bf16; r5/e13 measured 1.18x with FP8 weights. A's
prefill steps (8,192 rows) are about half of its time and compute-bound, so the GEMM's
rate there bounds what FP8 can give. Per layer and row count (1, 256, 8,192), timed from a
CUDA graph (median), TFLOP/s and the ratio to bf16 for:

- ``bf16``: ``F.linear`` on bf16 weights (the dense layers);
- ``rowwise``: ``torch._scaled_mm`` with per-token x per-channel scales, as
  ``server/quantization/fp8.py`` runs it (the activations' quantization kernel included);
- ``rowwise-fast``: the same with ``use_fast_accum=True``;
- ``tensor`` / ``tensor-fast``: one scale per operand (a static-scale checkpoint's GEMM).

Each line's ``err`` is the relative error against the fp32 product of the row-wise
quantized operands, dequantized: for ``rowwise-fast`` what fast accumulation costs at
K = 4,096 and 14,336; the ``tensor`` variants quantize coarser, and their error says so.

    python bench/fp8_mm.py [--out-dir DIR] [--rows 1,256,8192]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096))
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def time_graph_ms(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median"))


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def variants(
    x: torch.Tensor, w: torch.Tensor
) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """The products to time for ``x [M, K]`` bf16 and ``w [N, K]`` bf16, and their fp32
    reference (the quantized operands, dequantized)."""
    from kvscale.server.layers import ops

    ws = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [N, 1]
    wq = (w.float() / ws).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    wt, ws_row = wq.t(), ws.view(1, -1)
    w_scale = ws.max().reshape(())
    wq_t = (w.float() / w_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).t()
    xq_ref, xs_ref = ops.fp8_quantize_groups(x, x.shape[-1])
    ref = (xq_ref.float() * xs_ref) @ (wq.float() * ws).t()
    x_scale = (x.float().abs().amax() / FP8_MAX).reshape(())
    one = torch.ones((), device=x.device)

    def rowwise(fast: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            xq, xs = ops.fp8_quantize_groups(x, x.shape[-1])
            return torch._scaled_mm(
                xq, wt, scale_a=xs, scale_b=ws_row, out_dtype=x.dtype, use_fast_accum=fast
            )

        return run

    def tensor(fast: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            return torch._scaled_mm(
                xq, wq_t, scale_a=x_scale, scale_b=w_scale * one, out_dtype=x.dtype,
                use_fast_accum=fast,
            )  # fmt: skip

        return run

    return {
        "bf16": lambda: F.linear(x, w),
        "rowwise": rowwise(False),
        "rowwise-fast": rowwise(True),
        "tensor": tensor(False),
        "tensor-fast": tensor(True),
        "quantize": lambda: ops.fp8_quantize_groups(x, x.shape[-1])[0],
    }, ref


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,256,8192")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    print(meta, flush=True)
    rows = []
    for m in (int(v) for v in args.rows.split(",")):
        for layer, k, n in LAYERS:
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
