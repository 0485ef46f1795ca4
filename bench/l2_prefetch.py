"""Does fetching the next GEMM's weights into L2 while a batch-1 decode step waits on
latency-bound kernels shorten the step? (Before any engine change: one GPU, no model.)

A step of ``--layers`` Llama-8B-shaped layers at one row, as TP=1 or TP=2's rank runs it
(``--shapes``), captured in a CUDA graph: per layer ``wait(ar)``, qkv, ``wait(attn)``, o,
``wait(ar)``, gate_up, SiLU-mul, down, where ``wait(us)`` is ``torch.cuda._sleep`` on one
thread for about that long (the all-reduce + norm, or RoPE + attention: kernels that
leave memory idle). Every layer has weights of its own, so each GEMM reads them from
memory as in a real step. Variants (each the median of ``--replays`` graph replays):

- ``gemms``: the GEMMs and SiLU only (no waits): the step's memory-bound part;
- ``base``: with the waits;
- ``pf``: ``base`` plus, on a second stream, ``l2_prefetch`` of the next GEMM's weights at
  the start of each wait (qkv during the first, o during attention's, the first
  ``--gate-up-mb`` MB of gate_up during the second); the GEMM does not wait for it;
- ``pf-join``: as ``pf``, each GEMM waits for its prefetch.

Printed: ms a step and the gain of each ``pf`` variant over ``base``, per prefetch mode
and grid size.

    python bench/l2_prefetch.py [--shapes tp2,tp1] [--modes prefetch,load,bulk]
        [--programs 32,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN = 4096
SHAPES = {  # per rank: (qkv N, o K, gate_up N, down K)
    "tp1": (6144, 4096, 28672, 14336),
    "tp2": (3072, 2048, 14336, 7168),
}
WAITS_US = {"tp1": (2.0, 7.0), "tp2": (5.0, 8.0)}  # (all-reduce + norm, RoPE + attention)


def sleep_cycles_per_us() -> float:
    """``torch.cuda._sleep``'s cycles a microsecond on this GPU, from one timed graph."""
    cycles = 20_000
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for _ in range(50):
                torch.cuda._sleep(cycles)
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return cycles * 50 / (start.elapsed_time(end) * 1000)


class Step:
    """The layers' weights and activations, and one step's capture."""

    def __init__(self, shape: str, layers: int) -> None:
        qkv_n, o_k, gu_n, down_k = SHAPES[shape]
        dev, dt = "cuda", torch.bfloat16

        def w(n: int, k: int) -> list[torch.Tensor]:
            return [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(layers)]

        self.qkv, self.o = w(qkv_n, HIDDEN), w(HIDDEN, o_k)
        self.gate_up, self.down = w(gu_n, HIDDEN), w(HIDDEN, down_k)
        self.x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
        self.attn = torch.randn(1, o_k, device=dev, dtype=dt)
        self.sink = torch.zeros(1024, device=dev, dtype=torch.int32)
        self.layers = layers

    def capture(self, waits: tuple[int, int] | None, mode: str | None, programs: int,
                gate_up_bytes: int, join: bool) -> torch.cuda.CUDAGraph:
        from kvscale.kernels.l2_prefetch import l2_prefetch

        main, side = torch.cuda.Stream(), torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()

        def fetch(t: torch.Tensor, nbytes: int | None = None) -> torch.cuda.Event | None:
            if mode is None:
                return None
            side.wait_stream(main)
            with torch.cuda.stream(side):
                l2_prefetch(t, self.sink, nbytes, mode, programs)
            done = torch.cuda.Event()
            done.record(side)
            return done

        def gemm(x: torch.Tensor, wt: torch.Tensor, ev: torch.cuda.Event | None) -> torch.Tensor:
            if join and ev is not None:
                main.wait_event(ev)
            return F.linear(x, wt)

        def wait(cycles: int) -> None:
            if waits is not None:
                torch.cuda._sleep(cycles)

        def body() -> None:
            x = self.x
            for i in range(self.layers):
                ar, attn = waits or (0, 0)
                ev = fetch(self.qkv[i])
                wait(ar)
                gemm(x, self.qkv[i], ev)
                ev = fetch(self.o[i])
                wait(attn)
                gemm(self.attn, self.o[i], ev)
                ev = fetch(self.gate_up[i], gate_up_bytes) if gate_up_bytes else None
                wait(ar)
                h = gemm(x, self.gate_up[i], ev)
                a = F.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2:]
                F.linear(a, self.down[i])
            if mode is not None:  # a capture joins only streams that it forked
                main.wait_stream(side)

        with torch.cuda.stream(main):
            body()  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=main):
                body()
        torch.cuda.synchronize()
        return g


def time_graph(g: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median ms a replay."""
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="tp2,tp1")
    p.add_argument("--modes", default="prefetch,bulk")
    p.add_argument("--programs", default="32,64,132")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--gate-up-mb", default="0,16", help="MB of gate_up to fetch (a list)")
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    per_us = sleep_cycles_per_us()
    meta = {"gpu": props.name, "torch": torch.__version__, "l2_bytes": props.L2_cache_size,
            "sleep_cycles_per_us": round(per_us, 1), "layers": args.layers}
    print(json.dumps(meta), flush=True)
    results: list[dict] = []
    for shape in args.shapes.split(","):
        step = Step(shape, args.layers)
        waits = tuple(round(us * per_us) for us in WAITS_US[shape])
        runs = [("gemms", None, None, 0, 0, False), ("base", waits, None, 0, 0, False)]
        for mode in args.modes.split(","):
            for programs in (int(x) for x in args.programs.split(",")):
                for gu_mb in (float(x) for x in args.gate_up_mb.split(",")):
                    for join in (False, True):
                        name = f"pf{'-join' if join else ''} {mode} x{programs} gu{gu_mb:g}"
                        runs.append((name, waits, mode, programs, int(gu_mb * 2**20), join))
        base = None
        for name, w, mode, programs, gub, join in runs:
            try:
                g = step.capture(w, mode, programs, gub, join)
                ms = time_graph(g, args.replays)
                again = time_graph(g, args.replays)
                del g
            except Exception as e:  # a mode the GPU lacks: say so, go on
                print(f"{shape} {name}: failed: {type(e).__name__}: {e}"[:400], flush=True)
                results.append({"shape": shape, "variant": name, "error": str(e)[:400]})
                continue
            base = ms if name == "base" else base
            row = {"shape": shape, "variant": name, "ms": round(ms, 4), "again": round(again, 4),
                   "waits_us": WAITS_US[shape]}
            if base is not None and name != "base":
                row["gain_ms"] = round(base - ms, 4)
            results.append(row)
            print(json.dumps(row), flush=True)
        del step
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
