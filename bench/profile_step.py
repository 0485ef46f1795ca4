"""Where an engine step's time goes, on CUDA with the 8B-shaped checkpoint.

1. A batch-1 request's first steps as a timeline: per ``step()`` call, the host time
   spent launching and the time blocked on the previous step's tokens.
2. torch.profiler over those steps: the CPU-side calls that take the time (a blocking
   copy, a pinned allocation or a sync shows up here) and the top GPU kernels.
3. Mixed prefill steps of six different token counts, each synchronized: a step far
   slower than the others compiled a kernel variant inside the run.
4. Steps shaped like workload B's: 64 decoding sequences alone (a graph replay), and with
   a 490-token prompt joining (eager), each synchronized, with the host's launch time:
   a launch time close to the step time means the step waits on the host, not the GPU.

    python bench/profile_step.py [--ckpt /tmp/llama31-8b-random]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _timed(launch: Callable[..., Any], cur: dict[str, float]) -> Callable[..., Any]:
    """``Worker.launch`` that records its host time and token count in ``cur``."""

    def timed_launch(step: Any) -> Any:
        t0 = time.perf_counter()
        out = launch(step)
        cur["launch_ms"] = 1e3 * (time.perf_counter() - t0)
        cur["tokens"] = float(sum(step.new_tokens_per_seq))
        return out

    return timed_launch


def _timeline(eng: Any, steps: int) -> list[dict[str, float]]:
    """Runs ``steps`` engine steps; per step: wall, launch and wait times (ms)."""
    from kvscale.server.worker.worker import PendingStep

    rows: list[dict[str, float]] = []
    cur: dict[str, float] = {}
    launch, result = eng.worker.launch, PendingStep.result
    timed_launch = _timed(launch, cur)

    def timed_result(self: Any) -> Any:
        t0 = time.perf_counter()
        out = result(self)
        cur["wait_ms"] = 1e3 * (time.perf_counter() - t0)
        return out

    eng.worker.launch = timed_launch
    PendingStep.result = timed_result  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            cur.clear()
            t0 = time.perf_counter()
            outs = eng.step()
            cur["step_ms"] = 1e3 * (time.perf_counter() - t0)
            cur["outputs"] = float(len(outs))
            rows.append(dict(cur))
    finally:
        eng.worker.launch = launch
        PendingStep.result = result  # type: ignore[method-assign]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/llama31-8b-random")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_bench import _prompts, ensure_checkpoint

    from kvscale.server import LLM, SamplingParams

    ckpt = Path(args.ckpt)
    ensure_checkpoint(ckpt)
    llm = LLM(str(ckpt), dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.85)
    eng = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(_prompts(8, 512, 5), greedy)  # warm-up
    llm.generate(_prompts(1, 128, 0), greedy)

    print("== 1. batch-1 timeline (128-token prompt, 8 tokens)")
    eng.add_request("c", _prompts(1, 128, 0)[0], greedy)
    for i, r in enumerate(_timeline(eng, 5)):
        print(f"step {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    while eng.has_unfinished_requests():
        eng.step()

    print("== 2. profiler over a batch-1 request's first 3 steps")
    eng.add_request("p", _prompts(1, 128, 0)[0], greedy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step()
    avg = prof.key_averages()
    print(avg.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
    print(avg.table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))

    print("== 3. mixed prefill steps of different sizes (each synchronized)")
    for k in range(6):
        for i, p in enumerate(_prompts(4, 500 + 3 * k, 10 + k)):
            eng.add_request(f"m{k}-{i}", p, SamplingParams(temperature=0, max_tokens=2))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        ms = 1e3 * (time.perf_counter() - t0)
        print(f"prefill step {k}: {4 * (500 + 3 * k)} tokens, {ms:.1f} ms")
        while eng.has_unfinished_requests():
            eng.step()

    _mixed_vs_decode(eng)


def _mixed_vs_decode(eng: Any) -> None:
    import torch

    from kvscale.server import SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_bench import _prompts

    print("== 4. 64 decoding sequences, alone and with a 490-token prompt joining")
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(_prompts(64, 128, 20)):
        eng.add_request(f"d{i}", p, params)
    for _ in range(4):  # the 64 prompts (8,192 tokens) fill one step; then all decode
        eng.step()
    launch = eng.worker.launch

    def one_step(label: str) -> None:
        cur: dict[str, float] = {}
        eng.worker.launch = _timed(launch, cur)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        eng.worker.launch = launch
        cur["step_ms"] = 1e3 * (time.perf_counter() - t0)
        print(f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in cur.items()))

    for k in range(3):
        one_step("decode only")
        eng.add_request(
            f"j{k}", _prompts(1, 490, 30 + k)[0], SamplingParams(temperature=0, max_tokens=1)
        )
        one_step("mixed")
    while eng.has_unfinished_requests():
        eng.step()


if __name__ == "__main__":
    main()
