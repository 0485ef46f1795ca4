"""A decode layer's MLP kernels in a CUDA graph, with and without programmatic dependent
launch (PDL, ``kernels/pdl.py``): where PDL's time goes.

Per variant, the median time of a graph replay of ``LAYERS`` x (fused add + RMSNorm ->
gate_up -> SiLU-and-mul -> down) on one row of the 8B model, alternating the variants
``REPEATS`` times (each replay reads every layer's own weights, 32 layers' worth: more
than the L2 holds, as in a step):

- ``int4_off``/``int4_on``: GPTQ-layout int4 GEMVs (groups of 128), PDL off / on (the
  GEMV requests its first tile's weights before it waits);
- ``int4_wait_first``: PDL on, the GEMV waits before its first load (``PDL=2``);
- ``int4_gemv_plain``: PDL on for the norm and SiLU only, the GEMV launched without it;
- ``int4_wait_only``: the GEMV compiled with its wait but launched without PDL (the wait
  returns at once): what the wait's place in the code costs by itself;
- ``bf16_off``/``bf16_on``: cuBLAS GEMMs (``F.linear``), PDL off / on for the norm and SiLU.

    python bench/pdl_chain.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, INTER, GROUP = 4096, 14336, 128
LAYERS = 32
REPLAYS = 20
REPEATS = 3


def _int4(k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    from kvscale.kernels import w4a16

    codes = torch.randint(0, 16, (k, n), generator=gen, device="cuda", dtype=torch.uint8)
    scales = torch.rand(k // GROUP, n, generator=gen, device="cuda") * 0.02
    return w4a16.pack_int4_rows(codes), scales, None


def build_weights(kind: str, gen: torch.Generator) -> list[tuple[Any, Any]]:
    """Per layer (gate_up, down): int4 (qweight, scales, None) or bf16 ``[N, K]``."""
    if kind == "int4":
        return [(_int4(HIDDEN, 2 * INTER, gen), _int4(INTER, HIDDEN, gen)) for _ in range(LAYERS)]
    return [
        (
            torch.randn(2 * INTER, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16) * 0.02,
            torch.randn(HIDDEN, INTER, generator=gen, device="cuda").to(torch.bfloat16) * 0.02,
        )
        for _ in range(LAYERS)
    ]


def _gemm(kind: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    from kvscale.kernels import w4a16

    if kind == "int4":
        return lambda x, w: w4a16.w4a16_gemm(x, *w, group_size=GROUP)
    return lambda x, w: F.linear(x, w)


def time_chain(kind: str, weights: list[tuple[Any, Any]]) -> float:
    """Median us per replay of the ``LAYERS``-layer MLP chain (kernels as now switched)."""
    from kvscale.kernels import activation, rmsnorm

    gemm = _gemm(kind)
    norm_w = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros_like(x)

    def chain() -> torch.Tensor:
        y = x
        for up, down in weights:
            rmsnorm.fused_add_rms_norm(y, res, norm_w, 1e-5)
            y = gemm(activation.silu_and_mul(gemm(y, up)), down)
        return y

    chain()  # compiles, allocates the split counters
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del g
    return statistics.median(times[2:])


def _variants() -> dict[str, tuple[str, bool, dict[str, int | bool] | None]]:
    """name -> (weights, PDL switch, the GEMV's launch options in place of pdl_launch's)."""
    return {
        "int4_off": ("int4", False, None),
        "int4_on": ("int4", True, None),
        "int4_wait_first": ("int4", True, {"PDL": 2, "launch_pdl": True}),
        "int4_gemv_plain": ("int4", True, {}),
        "int4_wait_only": ("int4", True, {"PDL": 1}),
        "bf16_off": ("bf16", False, None),
        "bf16_on": ("bf16", True, None),
    }


def run() -> dict[str, Any]:
    from kvscale.kernels import pdl, w4a16

    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {k: build_weights(k, gen) for k in ("int4", "bf16")}
    default_launch = w4a16.pdl_launch
    times: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        for name, (kind, on, gemv_opts) in _variants().items():
            os.environ["KVSCALE_PDL"] = "1" if on else "0"
            pdl.reload_switch()
            w4a16.pdl_launch = default_launch if gemv_opts is None else lambda _d, o=gemv_opts: o
            try:
                times.setdefault(name, []).append(time_chain(kind, weights[kind]))
            finally:
                w4a16.pdl_launch = default_launch
    os.environ["KVSCALE_PDL"] = "1"
    pdl.reload_switch()
    return {
        "us_per_replay": {k: statistics.median(v) for k, v in times.items()},
        "runs": times,
        "layers": LAYERS,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    args = ap.parse_args()
    res = run()
    res |= {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "pdl_chain.json").write_text(json.dumps(res, indent=2))
    for name, us in res["us_per_replay"].items():
        print(f"{name:18s} {us:9.1f} us/replay  {us / LAYERS:7.2f} us/layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
