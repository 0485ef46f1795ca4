"""Profiles one prefill step (16 prompts x 512 tokens) of the 8B-shaped model on CUDA and
prints the GPU kernels that take the time (torch.profiler), to find what limits
workload A. Uses (or writes) the checkpoint of bench/engine_bench.py.

    python bench/profile_step.py [--ckpt /tmp/llama31-8b-random]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="/tmp/llama31-8b-random")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_bench import LLAMA_31_8B, _prompts

    from kvscale.server import LLM, SamplingParams
    from kvscale.server.demo_model import write_random_checkpoint

    ckpt = Path(args.ckpt)
    if not (ckpt / "model.safetensors.index.json").is_file():
        write_random_checkpoint(ckpt, "llama", LLAMA_31_8B, dtype="bfloat16", device="cuda")
    llm = LLM(
        str(ckpt),
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        gpu_memory_utilization=0.85,
    )
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate(_prompts(16, 512, 5), params)  # warm-up: compile every kernel variant
    for i, p in enumerate(_prompts(16, 512, 6)):
        eng.add_request(f"p{i}", p, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    print(f"prefill step of {16 * 512} tokens: {dt * 1e3:.1f} ms")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )
    while eng.has_unfinished_requests():
        eng.step()


if __name__ == "__main__":
    main()
