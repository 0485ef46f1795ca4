"""The batch-1 W4A16 GEMV at the 8B model's shapes with and without zero points (AWQ's
and GPTQ's symmetric layout), in 64- and 128-row K tiles: lease r26 gave int4 C 4.17 ms
for the GPTQ checkpoint against 3.47 ms for AWQ, after the GEMV moved to 128-row tiles
(before: within 0.5% of each other). Graph-timed (``bench/kernels.py``'s timer), us a
product, one JSON line each."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from kvscale.kernels import w4a16


def main() -> None:
    path = Path(__file__).with_name("kernels.py")
    spec = importlib.util.spec_from_file_location("kvscale_bench_kernels", path)
    assert spec is not None and spec.loader is not None
    kernels = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kernels  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(kernels)
    bench, group = kernels.Bench(quick=False), kernels.W4A16_GROUP
    for layer, k, n in kernels.W4A16_LAYERS:
        ops = bench._w4a16_operands(1, k, n)
        x, qw, s = ops["x"], ops["qweight"], ops["scales"]
        for zeros in (ops["zeros"], None):
            for block_k in (64, 128):
                cfg = w4a16.w4a16_config(1, n, k, x.device, gemv_block_k=block_k)

                def run(z=zeros, c=cfg, x=x, qw=qw, s=s) -> object:
                    return w4a16.w4a16_gemm(x, qw, s, z, group, config=c)

                row = {"layer": layer, "zeros": zeros is not None, "block_k": block_k}
                row["us"] = 1e3 * bench.time_graph_ms(run)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
