"""The all-reduce of a TP=2 step on its own: NCCL against the one-shot kernel, on 2 GPUs.

    python bench/all_reduce.py --out-dir RESULTS [--dtype bf16]

Two NCCL processes (GPU 0 and 1), set up as the engine does. For each row count (tokens
of hidden size 4096), a CUDA graph holds ``OPS`` launches of one variant and is
replayed ``REPLAYS`` times between CUDA events; the time per launch (us) is the mean:

- ``nccl``: ``dist.all_reduce`` (what a row-parallel layer did before);
- ``nccl+norm``: that, then the ``fused_add_rms_norm`` kernel (what the step ran after
  each row-parallel layer before);
- ``one_shot``: the one-shot sum alone (the embedding's sum);
- ``one_shot+norm``: the fused one-shot sum + residual add + RMSNorm (what it runs now).

Rank 0 writes ``all_reduce.json`` (and prints the table); the graph replays include the
GPUs' wait for each other, as in a decode step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
from pathlib import Path
from typing import Any

import torch

HIDDEN = 4096
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
OPS = 20
REPLAYS = 50
EPS = 1e-5


def _time_graph(fn: Any) -> float:
    """Microseconds per call of ``fn`` (``OPS`` calls captured in one graph)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(OPS):
            fn()
    graph.replay()  # warm
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (REPLAYS * OPS)


def _rank(rank: int, port: int, dtype: torch.dtype, out: str) -> None:
    import torch.distributed as dist

    from kvscale.kernels.rmsnorm import fused_add_rms_norm
    from kvscale.server.distributed.group import apply_env
    from kvscale.server.distributed.one_shot import setup_one_shot

    apply_env()
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device
    )
    comm = setup_one_shot(None, rank, 2, device, HIDDEN, dtype, max_rows=max(ROWS))
    results: dict[str, dict[str, float]] = {}
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, device=device, dtype=dtype) * 1e-3
        residual = torch.randn(rows, HIDDEN, device=device, dtype=dtype)
        weight = torch.ones(HIDDEN, device=device, dtype=dtype)

        def nccl_norm(
            x: torch.Tensor = x, r: torch.Tensor = residual, w: torch.Tensor = weight
        ) -> None:
            dist.all_reduce(x)
            fused_add_rms_norm(x, r, w, EPS)

        row: dict[str, float] = {
            "nccl": _time_graph(lambda x=x: dist.all_reduce(x)),
            "nccl+norm": _time_graph(nccl_norm),
        }
        if comm is not None:
            row["one_shot"] = _time_graph(lambda x=x: comm.all_reduce(x))
            row["one_shot+norm"] = _time_graph(
                lambda x=x, r=residual, w=weight: comm.all_reduce(x, r, w, EPS)
            )
        results[str(rows)] = row
    dist.barrier()
    if rank == 0:
        meta = {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "dtype": str(dtype),
            "hidden": HIDDEN,
            "ops_per_graph": OPS,
            "replays": REPLAYS,
            "one_shot": comm is not None,
        }
        Path(out, "all_reduce.json").write_text(json.dumps({"meta": meta, "us": results}, indent=1))
        names = ["nccl", "nccl+norm", "one_shot", "one_shot+norm"]
        print("| rows | " + " | ".join(f"{n} (us)" for n in names) + " |")
        for rows, row in results.items():
            cells = " | ".join(f"{row[n]:.2f}" if n in row else "-" for n in names)
            print(f"| {rows} | {cells} |", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        sys.exit("needs 2 CUDA GPUs")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, dtype, args.out_dir)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
