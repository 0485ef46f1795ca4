"""The in-process draft runner's host time around its forwards (any device; on the CPU
the forwards themselves run on it too, which leaves the caches cold, as a GPU host's are
not: compare versions on one machine, not figures across machines).

Drives ``DraftRunner.propose`` as the engine does at steady state: ``--batch`` greedy
sequences of 200 tokens, k = 4, 2 drafts and 1 token accepted a call. Prints medians
(us) of: the time from ``propose`` to its first forward (the catch-up's host work, on
the critical path: the GPU has nothing queued), from the last forward's return to
``propose``'s return, and a one-token decode step's host work before its forward.

    python bench/profile_draft_runner.py [--ckpt DIR] [--device cpu] [--batch 1,16] [--calls 150]

Without ``--ckpt`` the demo's random-weight Llama checkpoint is built in a temporary
folder.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvscale.server.demo_model import build_checkpoint
from kvscale.server.spec_decode.draft_runner import DraftRunner, draft_engine_config
from kvscale.server.spec_decode.proposer import DraftRequest

K = 4
WARMUP = 30  # calls left out of the medians


def measure(runner: DraftRunner, batch: int, calls: int) -> dict[str, float]:
    """Medians in microseconds (see the module docstring)."""
    marks: dict[str, float] = {}
    first: list[float] = []
    tail: list[float] = []
    prep: list[float] = []
    forward, decode = runner.worker.forward, runner._decode

    def timed_forward(step: Any) -> Any:
        now = time.perf_counter()
        if "propose" in marks:
            first.append(now - marks.pop("propose"))
        if "decode" in marks:
            prep.append(now - marks.pop("decode"))
        out = forward(step)
        marks["returned"] = time.perf_counter()
        return out

    def timed_decode(*args: Any) -> None:
        marks["decode"] = time.perf_counter()
        decode(*args)

    runner.worker.forward = timed_forward  # type: ignore[method-assign]
    runner._decode = timed_decode  # type: ignore[method-assign]
    try:
        reqs = [DraftRequest(i, list(range(3 + i, 200 + i)), K, 0.0) for i in range(batch)]
        for call in range(calls):
            if call == WARMUP:
                for samples in (first, tail, prep):
                    samples.clear()
            marks["propose"] = time.perf_counter()
            p = runner.propose(reqs)
            tail.append(time.perf_counter() - marks["returned"])
            reqs = [
                DraftRequest(r.seq_id, [*r.token_ids, *p.tokens[i, :2].tolist(), 7], K, 0.0)
                for i, r in enumerate(reqs)
            ]
    finally:
        del runner.worker.forward, runner._decode  # the instance's wrappers
    runner.reset()
    return {
        "first_forward_us": statistics.median(first) * 1e6,
        "tail_us": statistics.median(tail) * 1e6,
        "decode_prep_us": statistics.median(prep) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", help="a draft checkpoint (default: the demo's, built here)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--calls", type=int, default=150)
    args = ap.parse_args()
    if args.calls <= WARMUP:
        ap.error(f"--calls must be > {WARMUP} (the warm-up)")
    torch.set_num_threads(1)
    ckpt = args.ckpt or str(build_checkpoint(Path(tempfile.mkdtemp()), arch="llama"))
    config = draft_engine_config(ckpt, device=args.device, max_num_seqs=64, max_model_len=2048)
    runner = DraftRunner.from_engine_config(config, k=K)
    for batch in (int(b) for b in args.batch.split(",")):
        m = measure(runner, batch, args.calls)
        print(
            f"batch {batch}, k={K}: propose -> first forward {m['first_forward_us']:.0f} us; "
            f"last forward -> return {m['tail_us']:.0f} us; a decode step's host work "
            f"before its forward {m['decode_prep_us']:.0f} us (medians of "
            f"{args.calls - WARMUP} calls)",
            flush=True,
        )


if __name__ == "__main__":
    main()
