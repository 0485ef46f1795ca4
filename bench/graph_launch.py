"""What a CUDA graph's launch costs the host, by what the graph holds (one GPU).

A batch-1 speculative step launches the target's decode graph only once the drafts are
known, and the GPU idles for as long as ``cudaGraphLaunch`` takes on the host (0.7-0.85
ms for the 8B model's graph on an H100 host, NOTES e47). This times the host side of
``CUDAGraph.replay()`` (median of ``--replays``, the GPU idle before each) for graphs of
``N`` nodes of one kind each: torch elementwise kernels, Triton kernels, one-row cuBLAS
GEMMs (``F.linear``), memsets, device-to-device copies, the three kernels in turn; then
for the engine's batch-1 decode graphs of demo models of ``--layers`` layers.

    python bench/graph_launch.py [--nodes 32,128,512] [--layers 2,8,32] [--out-dir DIR]

``--transitions`` measures the device instead (NOTES e80): the time a replay of a graph of
``--graph-nodes`` kernels like a decode step's (elementwise, Triton, one-row GEMMs in turn)
takes on the GPU, replays queued back to back behind a sleep kernel, when that graph is
captured alone, after ``--others`` graphs that allocate from the same memory pool (as the
pieces' graphs precede the decode graphs under ``--cuda-graph-mode auto``), after them
into a pool of its own, or before them; and alone with parts of a decode step's boundary
before each replay (``BOUNDARIES``, NOTES e81: the previous tokens' device-to-host copy,
a pinned host-to-device copy of the inputs, a small kernel; the copies in the main stream
or on streams of their own): what the boundary costs the device when no host is late.
Each condition runs in a process of its own, in
turn, ``--repeats`` times; the table gives each one's extra time a node against ``alone``.

    python bench/graph_launch.py --transitions [--graph-nodes 420] [--others 660] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
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


def captured(body: Callable[[], object], pool: object = None) -> torch.cuda.CUDAGraph:
    """``body`` captured once (after a warm-up run), into ``pool`` (None: its own)."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
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


CONDITIONS = (
    "alone",
    "after-others",
    "after-others-own-pool",
    "before-others",
    "with-inputs",
    "with-kernel",
    "with-inputs-side-copy",
    "with-boundary",
    "with-boundary-side-copies",
)
# What each "with-*" condition enqueues before each replay (``step_inputs``).
BOUNDARY_PARTS = ("d2h", "side-d2h", "h2d", "side-h2d", "kernel")
BOUNDARIES = {
    "with-inputs": ("h2d", "kernel"),
    "with-kernel": ("kernel",),
    "with-inputs-side-copy": ("side-h2d", "kernel"),
    "with-boundary": ("d2h", "h2d", "kernel"),
    "with-boundary-side-copies": ("side-d2h", "side-h2d", "kernel"),
}
SLEEP_CYCLES = 200_000_000  # ~0.1 s: more than enqueueing the replays (r44: <= 0.85 ms each)


def decode_like(nodes: int) -> Callable[[], None]:
    """``nodes`` kernels in the mix of a decode step: a one-row GEMM, a Triton kernel and
    a torch elementwise kernel in turn, each reading what the one before wrote."""
    dev = torch.device("cuda")
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) / 64
    h = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)

    def body() -> None:
        x = h
        for i in range(nodes):
            if i % 3 == 0:
                x = torch.nn.functional.linear(x, w)
            elif i % 3 == 1:
                _add_one[(4,)](x, x.numel(), BLOCK=1024)
            else:
                x = x * 0.5

    return body


def other_graphs(count: int, pool: object) -> list[torch.cuda.CUDAGraph]:
    """``count`` graphs captured into ``pool``, each allocating intermediates of 1-64 MB
    (as the pieces' graphs do at their token counts) and writing one small output."""
    dev = torch.device("cuda")
    out = torch.zeros(1, device=dev)

    def body(mb: int) -> None:
        a = torch.ones(mb * 2**18, device=dev)  # mb MB of fp32
        out.copy_((a * 2).sum(0, keepdim=True))

    return [captured(functools.partial(body, 1 << (i % 7)), pool) for i in range(count)]


def step_inputs(parts: tuple[str, ...]) -> Callable[[], None]:
    """What a decode step enqueues between two graphs, in order (``BOUNDARIES``):
    ``d2h``, the previous step's sampled tokens copied to pinned memory; ``h2d``, a pinned
    host-to-device copy of the step's inputs; ``kernel``, a small kernel over them. The
    ``side-`` copies run on streams of their own: the H2D one is issued at once (its
    host data is ready) and the main stream waits on its event; the D2H one waits on an
    event after the previous replay. They ask whether the gap before a graph comes from
    the main stream waiting on the copy engine."""
    host = torch.zeros(4096, dtype=torch.int64).pin_memory()
    staged = torch.zeros(4096, dtype=torch.int64, device="cuda")
    tokens = torch.zeros(8, dtype=torch.int64, device="cuda")
    tokens_host = torch.zeros(8, dtype=torch.int64).pin_memory()
    side_h2d, side_d2h = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def enqueue() -> None:
        for part in parts:
            if part == "d2h":
                tokens_host.copy_(tokens, non_blocking=True)
            elif part == "side-d2h":
                side_d2h.wait_stream(main)
                with torch.cuda.stream(side_d2h):
                    tokens_host.copy_(tokens, non_blocking=True)
            elif part == "h2d":
                staged.copy_(host, non_blocking=True)
            elif part == "side-h2d":
                ready = torch.cuda.Event()
                with torch.cuda.stream(side_h2d):
                    staged.copy_(host, non_blocking=True)
                    ready.record(side_h2d)
                main.wait_event(ready)
            elif part == "kernel":
                _add_one[(4,)](staged, staged.numel(), BLOCK=1024)
            else:
                raise ValueError(f"unknown boundary part {part!r}; known: {BOUNDARY_PARTS}")

    enqueue()  # compiles the kernel for int64 before anything is timed
    torch.cuda.synchronize()
    return enqueue


def replay_device_us(
    graph: torch.cuda.CUDAGraph, replays: int, before: Callable[[], None] = lambda: None
) -> float:
    """Device time a replay (us): ``replays`` replays, each after ``before()``, queued
    back to back behind a sleep kernel, so the host's launches never make the GPU wait,
    timed by two events."""
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    graph.replay()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    for _ in range(replays):
        before()
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def one_condition(condition: str, nodes: int, others: int, replays: int) -> float:
    """Device us a replay of the decode-like graph under ``condition`` (this process)."""
    body = decode_like(nodes)
    pool = torch.cuda.graph_pool_handle()
    keep: list[torch.cuda.CUDAGraph] = []
    if condition in ("after-others", "after-others-own-pool"):
        keep = other_graphs(others, pool)
    if condition == "after-others-own-pool":
        pool = torch.cuda.graph_pool_handle()
    graph = captured(body, pool)
    if condition == "before-others":
        keep = other_graphs(others, pool)
    parts = BOUNDARIES.get(condition)
    before = step_inputs(parts) if parts else (lambda: None)
    us = replay_device_us(graph, replays, before)
    del keep
    return us


def transition_table(runs: dict[str, list[float]], nodes: int) -> list[dict[str, float | str]]:
    """Per condition: the median device us a replay over its runs, and its extra time
    against ``alone``'s median, a replay and a node (us; a transition per node)."""
    base = statistics.median(runs["alone"])
    return [
        {
            "condition": c,
            "replay_us": statistics.median(v),
            "extra_us": statistics.median(v) - base,
            "extra_us_per_node": (statistics.median(v) - base) / nodes,
        }
        for c, v in runs.items()
    ]


def transitions(nodes: int, others: int, replays: int, repeats: int) -> dict[str, object]:
    """Every condition in a process of its own, in turn, ``repeats`` times."""
    runs: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    for _ in range(repeats):
        for c in CONDITIONS:
            out = subprocess.run(
                [sys.executable, __file__, "--condition", c, "--graph-nodes", str(nodes),
                 "--others", str(others), "--replays", str(replays)],
                capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode:
                raise SystemExit(f"condition {c} failed ({out.returncode}):\n{out.stderr[-3000:]}")
            runs[c].append(float(out.stdout.strip().splitlines()[-1]))
    table = transition_table(runs, nodes)
    for row in table:
        print(
            f"{row['condition']:>22}: {row['replay_us']:8.1f} us a replay, "
            f"{row['extra_us']:+.1f} us a replay and {row['extra_us_per_node']:+.3f} us a "
            "node against alone",
            flush=True,
        )
    return {"nodes": nodes, "others": others, "replays": replays, "runs": runs, "table": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="32,128,512")
    ap.add_argument("--layers", default="2,8,32", help="the demo models' layer counts")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--transitions", action="store_true", help="the device side (see above)")
    ap.add_argument("--graph-nodes", type=int, default=420)
    ap.add_argument("--others", type=int, default=660)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--condition", choices=CONDITIONS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.condition:  # one run, in a process of its own: prints the device us a replay
        print(one_condition(args.condition, args.graph_nodes, args.others, args.replays))
        return
    if args.transitions:
        res = transitions(args.graph_nodes, args.others, args.replays, args.repeats)
        if args.out_dir:
            Path(args.out_dir, "graph_transitions.json").write_text(json.dumps(res, indent=1))
        return
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
