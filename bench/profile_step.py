"""Where an engine step's time goes, on CUDA with the 8B-shaped checkpoint.

1. A batch-1 request's first steps as a timeline: per ``step()`` call, the host time
   spent launching and the time blocked on the previous step's tokens.
2. torch.profiler over those steps: the CPU-side calls that take the time (a blocking
   copy, a pinned allocation or a sync shows up here) and the top GPU kernels.
3. Mixed prefill steps of six different token counts, each synchronized: a step far
   slower than the others compiled a kernel variant inside the run.
4. Steps shaped like workload B's: 64 decoding sequences alone (a decode graph replay),
   and with a prompt of 100, 490, 700 or 2,000 tokens joining (piecewise graphs or eager,
   as the mode's dispatcher decides), each synchronized, with the host's launch time: a
   launch time close to the step time means the step waits on the host, not the GPU.
5. The host's functions in such mixed steps (64 decodes + a 490-token prompt, ten of
   them) under cProfile, by own time and by cumulative time: what a mixed step's launch
   spends its milliseconds on.

Each ``--modes`` value (a ``--cuda-graph-mode``) gets an engine of its own, in turn, with
its start-up time printed; e.g. the mixed-step enqueue time with and without piecewise
graphs, in one lease:

    python bench/profile_step.py [--ckpt /tmp/llama31-8b-random]
    python bench/profile_step.py --modes full_decode_only,full_and_piecewise --sections 4
    python bench/profile_step.py --quantization none,fp8 --sections 345
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

    worker = getattr(launch, "__self__", None)

    def timed_launch(step: Any) -> Any:
        t0 = time.perf_counter()
        out = launch(step)
        cur["launch_ms"] = 1e3 * (time.perf_counter() - t0)
        cur["tokens"] = float(sum(step.new_tokens_per_seq))
        if worker is not None:
            d = worker.dispatcher.dispatch(step.num_tokens, step.graph_size)
            cur["graph"] = f"{d.kind} {d.size}" if d.size else d.kind  # type: ignore[assignment]
        return out

    return timed_launch


def _fmt(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


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
    ap.add_argument(
        "--modes",
        default="full_decode_only",
        help="comma list of --cuda-graph-mode values, each profiled on an engine of its own",
    )
    ap.add_argument("--sections", default="1234", help="which sections to run, e.g. 4")
    ap.add_argument("--compile-cache-dir", default="/tmp/kvscale/compile-cache")
    ap.add_argument(
        "--quantization",
        default="",
        help="comma list of engines' --quantization values, each profiled in every mode "
        "('' or none: bf16 weights; fp8: FP8 weights)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_bench import ensure_checkpoint

    ckpt = Path(args.ckpt)
    ensure_checkpoint(ckpt)
    for quant in args.quantization.split(","):
        for mode in args.modes.split(","):
            _profile_engine(ckpt, mode, quant, args.sections, args.compile_cache_dir)


def _profile_engine(ckpt: Path, mode: str, quant: str, sections: str, cache_dir: str) -> None:
    """Starts an engine (``quant``: a ``--quantization`` value, '' or 'none' for the
    checkpoint's own weights), warms it up, runs ``sections`` and frees it."""
    import gc

    import torch
    from engine_bench import _prompts

    from kvscale.server import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        str(ckpt),
        dtype="bfloat16",
        max_model_len=2048,
        gpu_memory_utilization=0.85,
        cuda_graph_mode=mode,
        compile_cache_dir=cache_dir,
        quantization=None if quant in ("", "none") else quant,
    )
    label = f"quantization={quant or 'none'} cuda_graph_mode={mode}"
    print(f"==== {label}: start-up {time.perf_counter() - t0:.1f} s", flush=True)
    pw = llm.engine.worker.piecewise
    if pw is not None:
        print(
            f"piecewise: compile {pw.compile_seconds:.1f} s, capture "
            f"{pw.capture_seconds:.1f} s, {len(pw.sizes)} sizes"
        )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(_prompts(8, 512, 5), greedy)  # warm-up
    llm.generate(_prompts(1, 128, 0), greedy)
    _warm_mixed(llm.engine)
    _sections(llm.engine, sections)
    del llm, pw
    gc.collect()
    torch.cuda.empty_cache()


def _sections(eng: Any, sections: str) -> None:
    if "1" in sections:
        _batch1_timeline(eng)
    if "2" in sections:
        _profiler(eng)
    if "3" in sections:
        _prefill_sizes(eng)
    if "4" in sections:
        _mixed_vs_decode(eng)
    if "5" in sections:
        _mixed_host_profile(eng)


def _profiler(eng: Any) -> None:
    import torch
    from engine_bench import _prompts
    from torch.profiler import ProfilerActivity, profile

    from kvscale.server import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
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


def _batch1_timeline(eng: Any) -> None:
    from engine_bench import _prompts

    from kvscale.server import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    print("== 1. batch-1 timeline (128-token prompt, 8 tokens)")
    eng.add_request("c", _prompts(1, 128, 0)[0], greedy)
    for i, r in enumerate(_timeline(eng, 5)):
        print(f"step {i}: {_fmt(r)}")
    while eng.has_unfinished_requests():
        eng.step()


def _prefill_sizes(eng: Any) -> None:
    import torch
    from engine_bench import _prompts

    from kvscale.server import SamplingParams

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


def _start_decoding(eng: Any, tag: str, seed: int) -> None:
    """64 requests of 128-token prompts, 200 tokens each, all decoding on return."""
    from engine_bench import _prompts

    from kvscale.server import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(_prompts(64, 128, seed)):
        eng.add_request(f"{tag}{i}", p, params)
    for _ in range(4):  # the 64 prompts (8,192 tokens) fill one step; then all decode
        eng.step()


# Section 4's prompts joining 64 decoding sequences, in order (tokens): three alike for
# the spread, then shorter and longer ones. Section 5 joins 490-token prompts.
JOINING = (490, 490, 490, 100, 700, 2000)


def _join(eng: Any, request_id: str, tokens: int, seed: int) -> None:
    """Adds one prompt of ``tokens`` random tokens that stops after its first token."""
    from engine_bench import _prompts

    from kvscale.server import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    eng.add_request(request_id, _prompts(1, tokens, seed)[0], params)


def _warm_mixed(eng: Any) -> None:
    """A mixed step of each shape sections 4 and 5 time (64 decodes beside each prompt
    size of ``JOINING``), run once first: their kernels' first compilation (r108:
    720 ms) stays out of the timed steps, as the server's warm-up keeps it out of its
    first requests' (``kvscale.server.api.app._warm_up``)."""
    _start_decoding(eng, "w", 10)
    for k, joining in enumerate(sorted(set(JOINING))):
        _join(eng, f"wj{k}", joining, 60 + k)
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()


def _mixed_vs_decode(eng: Any) -> None:
    import torch

    print("== 4. 64 decoding sequences, alone and with a prompt joining")
    _start_decoding(eng, "d", 20)
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
        print(f"{label}: {_fmt(cur)}")

    for k, joining in enumerate(JOINING):
        one_step("decode only")
        _join(eng, f"j{k}", joining, 30 + k)
        one_step(f"mixed, {joining}-token prompt joining")
    while eng.has_unfinished_requests():
        eng.step()


def _mixed_host_profile(eng: Any, steps: int = 10, top: int = 30) -> None:
    import cProfile
    import io
    import pstats

    import torch

    print(f"== 5. the host's functions in {steps} mixed steps (64 decodes + a 490-token prompt)")
    _start_decoding(eng, "h", 40)
    prof = cProfile.Profile()
    launched = 0.0
    for k in range(steps):
        eng.step()  # a decode-only step between the mixed ones, as in section 4
        _join(eng, f"hj{k}", JOINING[0], 50 + k)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        eng.step()
        prof.disable()
        launched += time.perf_counter() - t0
        torch.cuda.synchronize()
    print(f"{1e3 * launched / steps:.2f} ms a mixed step's step() call under cProfile")
    for order in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
        print(buf.getvalue())
    while eng.has_unfinished_requests():
        eng.step()


if __name__ == "__main__":
    main()
