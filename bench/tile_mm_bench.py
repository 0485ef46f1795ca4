"""``kernels/tile_mm.py``'s tiles against cuBLAS at the rows of a decode step (8B layers).

A's decode steps (248 rows) spend ~7.0 ms in cuBLAS's bf16 GEMMs against ~5.0 at the
tensor cores' measured rate and ~4.7 at the weights' read; FP8 weights spend ~3.9 ms
against ~2.4-2.5 (NOTES e94). Per 8B layer, row count and dtype (bf16; FP8 E4M3 with
row-wise scales, the head bf16 only), each tile config's time per call from CUDA-graph
replays cycling through weight copies over 4x the L2 (``gemm_rows.time_variant``), beside
cuBLAS's (``F.linear``; ``torch._scaled_mm`` with fast accumulation, as
``server/quantization/fp8.py`` calls it), the relative error against the fp32 product,
and a summary: each case's best config, and one decode step's GEMMs (32 layers and the
head) with cuBLAS and with the best tile of each layer.

    python bench/tile_mm_bench.py [--out-dir DIR] [--rows 64,128,160,248] [--dtypes bf16,fp8]
        [--configs default|small] [--name tile_mm_bench.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvscale.kernels.fp8 import FP8_E4M3 as FP8
from kvscale.kernels.tile_mm import TileConfig, tile_mm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_rows  # bench/ is not a package

NUM_LAYERS = 32
CONFIGS = {
    # decode's larger batches (A: 248 rows, B: ~160, D c=64: ~64)
    "default": tuple(
        TileConfig(m, n, kb, w, s, tma)
        for tma in (False, True)
        for m, n, kb, w, s in (
            (64, 64, 128, 4, 4),
            (64, 128, 128, 4, 4),
            (64, 256, 128, 4, 3),
            (128, 64, 128, 4, 4),
            (128, 128, 128, 4, 4),
            (128, 128, 128, 8, 4),
            (128, 128, 256, 8, 3),
            (128, 256, 128, 8, 3),
            (256, 64, 128, 8, 3),
            (256, 128, 128, 8, 3),
        )
    ),
    # 1-64 rows, where the weights' read is all there is: 16-row tiles (mma.sync, the
    # operands in fp16 for FP8), narrow columns so that small layers fill the SMs
    "small": tuple(
        TileConfig(m, n, kb, w, s, tma)
        for m, n, kb, w, s, tma in (
            (16, 32, 128, 4, 4, False),
            (16, 32, 256, 2, 4, False),
            (16, 64, 128, 4, 4, False),
            (16, 64, 256, 4, 3, False),
            (16, 64, 256, 4, 4, False),
            (16, 128, 128, 4, 4, False),
            (16, 128, 256, 4, 3, False),
            (32, 64, 128, 4, 4, False),
            (64, 64, 128, 4, 4, False),
            (64, 128, 128, 4, 4, False),
            (16, 64, 128, 4, 4, True),
            (16, 64, 256, 4, 4, True),
            (16, 128, 256, 4, 3, True),
            (64, 64, 128, 4, 4, True),
        )
    ),
}


def operands(
    dtype: str, n: int, k: int, m: int, copies: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """(x, x's row scales or None, [(w, w's channel scales or None)] * copies) on CUDA."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    if dtype == "bf16":
        return x, None, [(w, None) for w in ws]

    def rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = t.float().abs().amax(dim=1).clamp(min=1e-12) / 448.0
        return (t.float() / s[:, None]).to(FP8), s

    xq, xs = rows(x)
    return xq, xs, [rows(w) for w in ws]


def reference(
    x: torch.Tensor, xs: torch.Tensor | None, w: torch.Tensor, s: torch.Tensor | None
) -> torch.Tensor:
    """The fp32 product of the operands, scaled by row and channel where given."""
    y = x.float() @ w.float().t()
    return y if xs is None else y * xs[:, None] * s[None, :]


Call = Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]], torch.Tensor]


def cublas(x: torch.Tensor, xs: torch.Tensor | None) -> Call:
    """cuBLAS's product of ``x`` and a weight copy ``(w, channel scales or None)``, as the
    engine calls it (``F.linear``; ``torch._scaled_mm`` row-wise, fast accumulation)."""
    if xs is None:
        return lambda _x, ws: F.linear(x, ws[0])
    x_s = xs.view(-1, 1)
    return lambda _x, ws: torch._scaled_mm(
        x, ws[0].t(), scale_a=x_s, scale_b=ws[1].view(1, -1), out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )  # fmt: skip


def tiled(x: torch.Tensor, xs: torch.Tensor | None, cfg: TileConfig) -> Call:
    """``tile_mm``'s product of the same operands with ``cfg``."""
    out = None if xs is None else torch.bfloat16
    return lambda _x, ws: tile_mm(x, ws[0], xs, ws[1], out_dtype=out, config=cfg)


def fits(cfg: TileConfig) -> bool:
    return cfg.smem_bytes() <= 200 * 1024


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, rows): the step's GEMM time with cuBLAS and with each layer's best tile
    (32 layers and the head once), in ms."""
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        for m in sorted({r["m"] for r in rows if r["dtype"] == dtype}):
            case = [r for r in rows if r["dtype"] == dtype and r["m"] == m]
            step = {"cublas": 0.0, "best": 0.0}
            for layer in sorted({r["layer"] for r in case}):
                mine = [r for r in case if r["layer"] == layer]
                times = {r["variant"]: r["us"] for r in mine}
                count = 1 if layer == "head" else NUM_LAYERS
                step["cublas"] += count * times["cublas"] / 1e3
                step["best"] += count * min(times.values()) / 1e3
            out.append({"dtype": dtype, "m": m, **step, "ratio": step["best"] / step["cublas"]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", default="64,128,160,248")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--configs", choices=tuple(CONFIGS), default="default")
    ap.add_argument("--name", default="tile_mm_bench.json")
    args = ap.parse_args(argv)
    meta = gemm_rows.run_meta(bench="tile_mm")
    import triton

    meta["triton"] = triton.__version__
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        for layer, n, k in gemm_rows.LAYERS:
            if dtype == "fp8" and layer == "head":
                continue  # FP8 checkpoints keep the head in bf16
            nbytes = n * k * (2 if dtype == "bf16" else 1)
            copies = gemm_rows.copies_for(nbytes, l2)
            for m in (int(r) for r in args.rows.split(",")):
                x, xs, ws = operands(dtype, n, k, m, copies)
                ref = reference(x, xs, *ws[0])
                variants = {"cublas": cublas(x, xs)}
                variants |= {c.name: tiled(x, xs, c) for c in CONFIGS[args.configs] if fits(c)}
                base = None
                for name, fn in variants.items():
                    try:
                        y = fn(x, ws[0]).float()
                        err = ((y - ref).norm() / ref.norm()).item()
                        t = gemm_rows.time_variant(fn, x, ws)
                    except Exception as e:  # a config the compiler or the GPU refuses
                        print(f"{dtype} {layer} M={m} {name}: {type(e).__name__}: {e}"[:300])
                        continue
                    base = t["us"] if name == "cublas" else base
                    tflops = 2 * m * n * k / (t["us"] / 1e6) / 1e12
                    row = {"dtype": dtype, "layer": layer, "m": m, "variant": name, **t,
                           "rel_error": err, "tflops": tflops,
                           "fraction_of_copy": nbytes / (t["us"] / 1e6) / 1e9
                           / meta["copy_gb_per_s"],
                           "vs_cublas": t["us"] / base if base else None}  # fmt: skip
                    results.append(row)
                    print(f"{dtype:4s} {layer:7s} M={m:<4d} {name:22s} {t['us']:8.1f} us "
                          f"{tflops:6.0f} TF/s {row['fraction_of_copy']:5.0%} of copy "
                          f"x{row['vs_cublas'] or 0:.3f} err {err:.1e}", flush=True)  # fmt: skip
                best = min((r for r in results if r["dtype"] == dtype and r["layer"] == layer
                            and r["m"] == m), key=lambda r: r["us"])  # fmt: skip
                print(f"  best {best['variant']} x{best['vs_cublas']:.3f}", flush=True)
                del x, xs, ws
            torch.cuda.empty_cache()
    steps = summary(results)
    for s in steps:
        print(f"step GEMMs {s['dtype']} M={s['m']}: cuBLAS {s['cublas']:.3f} ms, best tiles "
              f"{s['best']:.3f} ms (x{s['ratio']:.3f})")  # fmt: skip
    gemm_rows.write_results(args.out_dir, args.name, meta,
                            {"rows": results, "steps": steps})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
