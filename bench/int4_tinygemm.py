"""The W4A16 GEMV against PyTorch's own int4 kernel (tinygemm, ``_weight_int4pack_mm``)
and the W4A16 tiles (``kernels/w4a16_tiles.py``, ``--tiles``).

int4 C is 0.57x of bf16 against a 0.45x target, its GEMV at ~46% of copy bandwidth
(NOTES e41-e46). PyTorch ships a CUDA int4 weight-only kernel (gpt-fast's and torchao's
``int4wo``) with its own packed layout. Per 8B layer at one row (group 128, symmetric and
with zero points): each kernel's time per call from CUDA-graph replays cycling through
enough weight copies (over 4x the L2) that every call reads its weights from memory
(``gemm_rows.time_variant``), its bytes' rate against the copy bandwidth, and its error
against the fp32 product with the dequantized weights.

``--tiles`` adds ``kernels/w4a16_tiles.py`` in each of ``TILES``' configs (``tiles-<name>``):
16-row tiles whose nibbles become 16-bit pairs a ``lop3`` each (NOTES e99).

    python bench/int4_tinygemm.py [--out-dir DIR] [--rows 1] [--tiles]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemm_rows import copies_for, run_meta, time_variant

from kvscale.kernels.testing import LLAMA_8B_LINEARS
from kvscale.kernels.tile_mm import TileConfig
from kvscale.kernels.w4a16 import dequantize_w4, pack_int4_rows, w4a16_gemm
from kvscale.kernels.w4a16_tiles import transpose_words, w4a16_tiles
from kvscale.server.quantization.int4 import tinygemm_pack, tinygemm_scales

GROUP = 128
# block_k_bytes of packed codes a step (64: 128 rows of K, 128: 256); narrow columns give
# the 4,096- and 6,144-column layers more programs (no split-K here)
TILES = {
    c.name: c
    for c in (
        TileConfig(16, 16, 64, num_warps=2, num_stages=4),
        TileConfig(16, 32, 64, num_warps=4, num_stages=4),
        TileConfig(16, 32, 128, num_warps=4, num_stages=3),
        TileConfig(16, 64, 64, num_warps=4, num_stages=4),
        TileConfig(16, 64, 128, num_warps=4, num_stages=3),
        TileConfig(16, 64, 128, num_warps=4, num_stages=4),
        TileConfig(16, 128, 64, num_warps=4, num_stages=4),
        TileConfig(16, 128, 128, num_warps=8, num_stages=3),
    )
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1")
    ap.add_argument("--inner-k-tiles", default="8", help="tinygemm's K tiling (2, 4, 8)")
    ap.add_argument("--zeros", default="symmetric,zeros")
    ap.add_argument("--tiles", action="store_true", help="add kernels/w4a16_tiles.py's configs")
    args = ap.parse_args(argv)
    meta = run_meta(group=GROUP)
    props, copy = torch.cuda.get_device_properties(0), meta["copy_gb_per_s"]
    rows_out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, k, n in LLAMA_8B_LINEARS:
        nbytes = n * k // 2 + 2 * (k // GROUP) * n * 2  # codes, scales and offsets
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
        scales = torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.02 + 0.001
        for zero_kind in args.zeros.split(","):
            if zero_kind == "symmetric":
                zeros = torch.full((k // GROUP, n), 8, device="cuda", dtype=torch.uint8)
            else:
                zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda", generator=gen)
                zeros = zeros.to(torch.uint8)
            q = pack_int4_rows(codes.t())
            w = dequantize_w4(q, scales, zeros, GROUP, k).t()  # [N, K]
            copies = copies_for(nbytes, props.L2_cache_size)
            zp = zeros if zero_kind == "zeros" else None

            def ours(x: torch.Tensor, wt: tuple) -> torch.Tensor:
                return w4a16_gemm(x, wt[0], wt[1], wt[2], GROUP)

            def tiny(x: torch.Tensor, wt: tuple) -> torch.Tensor:
                return torch.ops.aten._weight_int4pack_mm(x, wt[0], GROUP, wt[1])

            kernels: list[tuple[str, Callable[..., torch.Tensor], list[tuple]]] = [
                ("ours", ours, [(q.clone(), scales.clone(), zp) for _ in range(copies)])
            ]
            if args.tiles:
                words = transpose_words(q)
                for label, cfg in TILES.items():

                    def tiled(x: torch.Tensor, wt: tuple, cfg: TileConfig = cfg) -> torch.Tensor:
                        return w4a16_tiles(x, wt[0], wt[1], wt[2], GROUP, cfg)

                    ws = [(words.clone(), scales.clone(), zp) for _ in range(copies)]
                    kernels.append((f"tiles-{label}", tiled, ws))
            sz = tinygemm_scales(scales, zp)
            for tiles in (int(t) for t in args.inner_k_tiles.split(",")):
                packed = tinygemm_pack(codes, tiles)
                label = "tinygemm" if tiles == 8 else f"tiny-k{tiles}"
                ws = [(packed.clone(), sz.clone()) for _ in range(copies)]
                kernels.append((label, tiny, ws))
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                ref = x.float() @ w.t()
                for kernel, fn, ws in kernels:
                    err = ((fn(x, ws[0]).float() - ref).norm() / ref.norm()).item()
                    t = time_variant(fn, x, ws)
                    rate = nbytes / (t["us"] / 1e6) / 1e9
                    row = {"layer": name, "m": m, "zeros": zero_kind, "kernel": kernel, **t,
                           "rel_error": err, "gb_per_s": rate}  # fmt: skip
                    row["fraction_of_copy"] = row["gb_per_s"] / copy
                    rows_out.append(row)
                    print(
                        f"{name:8s} M={m} {zero_kind:9s} {kernel:24s} {t['us']:7.1f} us "
                        f"{row['gb_per_s']:6.0f} GB/s ({row['fraction_of_copy']:.0%}) "
                        f"err {err:.1e}",
                        flush=True,
                    )
            del kernels
            torch.cuda.empty_cache()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "int4_tinygemm.json").write_text(json.dumps({"meta": meta, "rows": rows_out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
