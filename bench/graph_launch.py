"""What a CUDA graph's launch costs the host, by what the graph holds (one GPU).

A batch-1 speculative step launches the target's decode graph only once the drafts are
known, and the GPU idles for as long as ``cudaGraphLaunch`` takes on the host (0.7-0.85
ms for the 8B model's graph on an H100 host, NOTES e47). This times the host side of
``CUDAGraph.replay()`` (median of ``--replays``, the GPU idle before each) for graphs of
``N`` nodes of one kind each: torch elementwise kernels, Triton kernels, one-row cuBLAS
GEMMs (``F.linear``), memsets, device-to-device copies, the three kernels in turn; then
for the engine's batch-1 decode graphs of demo models of ``--layers`` layers.

    python bench/graph_launch.py [--nodes 32,128,512] [--layers 2,8,32] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)


def replay_host_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median host time of ``graph.replay()`` (us), the GPU idle before each."""
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def captured(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``body`` captured once (after a warm-up run)."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def synthetic(nodes: int, replays: int) -> dict[str, float]:
    """Host us a replay of ``nodes`` nodes of each kind."""
    dev = torch.device("cuda")
    x = torch.zeros(4096, device=dev)
    y = torch.zeros(4096, device=dev)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    a = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)

    def elementwise() -> None:
        for _ in range(nodes):
            x.add_(1)

    def triton_kernels() -> None:
        for _ in range(nodes):
            _add_one[(4,)](x, x.numel(), BLOCK=1024)

    def gemms() -> None:
        for _ in range(nodes):
            torch.nn.functional.linear(a, w)

    def memsets() -> None:
        for _ in range(nodes):
            x.zero_()

    def copies() -> None:
        for _ in range(nodes):
            y.copy_(x)

    def mixed() -> None:  # three kernels in turn: distinct functions, one stream
        for i in range(nodes):
            if i % 3 == 0:
                x.add_(1)
            elif i % 3 == 1:
                _add_one[(4,)](x, x.numel(), BLOCK=1024)
            else:
                torch.nn.functional.linear(a, w)

    out = {}
    for name, body in (
        ("elementwise", elementwise),
        ("triton", triton_kernels),
        ("gemm 1 x 4096 x 4096", gemms),
        ("memset", memsets),
        ("copy", copies),
        ("mixed", mixed),
    ):
        out[name] = replay_host_us(captured(body), replays)
    return out


def engine_graph(layers: int, replays: int, tmp: Path) -> dict[str, object]:
    """The decode graph of batch 1 of a ``layers``-layer demo model, as the engine
    captures it: host us a replay."""
    from kvscale.server import LLM
    from kvscale.server.demo_model import build_checkpoint

    ckpt = build_checkpoint(tmp / "ckpt", arch="llama", dtype="bfloat16", num_hidden_layers=layers)
    llm = LLM(str(ckpt), device="cuda", cuda_graph_max_batch=1, num_kv_blocks=64)
    graph = llm.engine.worker.graphs.graphs[1]
    res: dict[str, object] = {"layers": layers, "replay_host_us": replay_host_us(graph, replays)}
    llm.engine.core.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="32,128,512")
    ap.add_argument("--layers", default="2,8,32", help="the demo models' layer counts")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, "
        f"{torch.cuda.get_device_name()}, driver CUDA {torch.version.cuda}"
    )
    res: dict[str, object] = {}
    for n in (int(v) for v in args.nodes.split(",")):
        row = synthetic(n, args.replays)
        res[f"synthetic_{n}"] = row
        print(f"{n:4d} nodes: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items()), flush=True)
    for layers in (int(v) for v in args.layers.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            eng = engine_graph(layers, args.replays, Path(tmp))
        res[f"engine_decode_graph_{layers}"] = eng
        print(
            f"engine decode graph, {layers} layers, batch 1: replay "
            f"{eng['replay_host_us']:.1f} us of host time",
            flush=True,
        )
    if args.out_dir:
        Path(args.out_dir, "graph_launch.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
