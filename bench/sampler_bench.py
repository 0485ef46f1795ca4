"""The sampler's time and memory per step at large batches, by sampling settings.

Every engine benchmark samples greedily (A, B, C and D send temperature 0), so what a step
pays to sample with temperature, top-k or top-p has never been timed. Per row count and
setting: the sampling math as ``Worker._sample`` runs it on one step's logits (``[rows,
V]`` in the model's dtype): the upcast to fp32, the copy kept for logprobs, the penalties'
mask and counts, ``sampler.sample`` and ``top_logprobs``; its median time per call from
CUDA events, and its peak memory beyond the logits (``max_memory_allocated``, on CUDA).

Settings: ``argmax`` (a greedy step: the argmax of the model-dtype logits), ``temperature``
(0.8), ``top_p`` (0.9, temperature 0.8), ``top_k_top_p`` (50 and 0.9; the k-th logit by
``topk``, as the engine finds it when it knows the batch's largest k) and
``top_k_top_p_sort`` (the same through a sort of every row, the engine's way before),
``top_p_sort`` (top-p's threshold from a sort of every row, the reference the CPU and
compiled engines run, instead of the radix-select kernel: NOTES e92), ``every`` (top-k by a
sort, top-p, min-p, the three penalties and 20 logprobs: what the KV pool's profile runs,
NOTES e90). On CUDA, ``--digit-bits 2,3,4,5`` also times the top-p kernel at each of those
widths (``threshold_bits<N>``: the softmax it needs, then the kernel), and ``--chunks
2048,4096,8192`` at each of those elements of a row per program (``threshold_chunk<N>``).

    python bench/sampler_bench.py [--out-dir DIR] [--rows 1,64,256,1024] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvscale.kernels.top_p import CHUNK, DIGIT_BITS, top_p_threshold
from kvscale.server.layers import ops
from kvscale.server.layers.sampler import SamplingTensors, sample, top_logprobs
from kvscale.server.sampling_params import MAX_LOGPROBS

SETTINGS = {  # name -> (temperature, top_k, top_p, min_p, penalties, logprobs, top_k_max)
    "argmax": None,
    "temperature": (0.8, 0, 1.0, 0.0, False, 0, 0),
    "top_p": (0.8, 0, 0.9, 0.0, False, 0, 0),
    "top_k_top_p": (0.8, 50, 0.9, 0.0, False, 0, 50),
    "top_k_top_p_sort": (0.8, 50, 0.9, 0.0, False, 0, 0),
    "top_p_sort": (0.8, 0, 0.9, 0.0, False, 0, 0),
    "every": (0.8, 50, 0.9, 0.05, True, MAX_LOGPROBS, 0),
}


def sampling_step(
    logits: torch.Tensor, setting: tuple | None, gen: torch.Generator
) -> torch.Tensor:
    """One step's sampling of ``logits [R, V]`` (the model's dtype) under ``setting``;
    returns the tokens ``[R]``."""
    if setting is None:
        return ops.argmax(logits)
    temperature, top_k, top_p, min_p, penalties, logprobs, top_k_max = setting
    rows, vocab = logits.shape
    dev = logits.device

    def full(v: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), v, dtype=dtype, device=dev)

    t = SamplingTensors(
        temperature=full(temperature),
        top_k=full(top_k, torch.int64),
        top_p=full(top_p),
        min_p=full(min_p),
        greedy=full(0, torch.bool),
        repetition_penalty=full(1.1),
        presence_penalty=full(0.1),
        frequency_penalty=full(0.1),
        do_top_k=top_k > 0,
        do_top_p_min_p=top_p < 1 or min_p > 0,
        do_penalties=penalties,
        top_k_max=top_k_max,
    )
    lg = logits.float()
    raw = lg.clone() if logprobs else None
    mask = counts = None
    if penalties:  # as Worker._penalty_inputs: one scatter each, 64 prompt / 32 output ids
        ids = torch.randint(0, vocab, (rows, 96), device=dev, generator=gen)
        mask = torch.zeros(rows, vocab, dtype=torch.bool, device=dev)
        mask.scatter_(1, ids[:, :64], True)
        counts = torch.zeros(rows, vocab, dtype=torch.int32, device=dev)
        counts.scatter_add_(1, ids[:, 64:], torch.ones_like(ids[:, 64:], dtype=torch.int32))
    tokens = sample(lg, t, [None] * rows, gen, mask, counts)
    if raw is not None:
        top_logprobs(raw, tokens, logprobs)
    return tokens


BY_SORT = {"top_p_sort"}  # settings run on the references, not the kernels


def threshold_step(probs: torch.Tensor, digit_bits: int, chunk: int = CHUNK) -> torch.Tensor:
    """The top-p kernel alone on ``probs [R, V]`` fp32 at top_p 0.9 (at any row count)."""
    top_p = torch.full_like(probs[:, 0], 0.9)
    return top_p_threshold(probs, top_p, digit_bits, min_rows=0, chunk=chunk)


def measure(
    rows: int, vocab: int, step: Callable[[torch.Tensor], Any], device: torch.device, reps: int
) -> dict:
    """Median ms per ``step(logits)`` (``[rows, vocab]`` bf16 ``randn``) over ``reps``
    calls after two warm-ups, and (CUDA) the peak memory beyond the logits in GiB."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, vocab, device=device, generator=gen).to(torch.bfloat16)
    cuda = device.type == "cuda"
    for _ in range(2):
        step(logits)
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(logits)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(logits)
            times.append((time.perf_counter() - t0) * 1e3)
    out: dict[str, Any] = {"ms": statistics.median(times), "ms_min": min(times)}
    if cuda:
        out["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1,64,256,1024")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--digit-bits", default="", help="e.g. 2,3,4,5: the top-p kernel alone")
    ap.add_argument("--chunks", default="", help="e.g. 2048,4096,8192: the same by chunk")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "vocab": args.vocab,
        "results": [],
    }
    gen = torch.Generator(device=device).manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        steps: dict[str, Callable[[torch.Tensor], Any]] = {
            name: functools.partial(sampling_step, setting=SETTINGS[name], gen=gen)
            for name in args.settings.split(",")
        }
        for bits in (int(b) for b in args.digit_bits.split(",") if b):
            steps[f"threshold_bits{bits}"] = lambda lg, b=bits: threshold_step(
                torch.softmax(lg.float(), dim=-1), b
            )
        for size in (int(c) for c in args.chunks.split(",") if c):
            steps[f"threshold_chunk{size}"] = lambda lg, c=size: threshold_step(
                torch.softmax(lg.float(), dim=-1), DIGIT_BITS, c
            )
        for name, step in steps.items():
            # the engine's kernels on CUDA (argmax, top-p), but for the sort's settings
            with ops.kernels(cuda and name not in BY_SORT):
                r = measure(rows, args.vocab, step, device, args.reps)
            res["results"].append({"rows": rows, "setting": name, **r})
            peak = f"  peak {r['peak_gib']:.2f} GiB" if "peak_gib" in r else ""
            print(f"{rows:5d} rows  {name:16s} {r['ms']:8.3f} ms{peak}", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sampler_bench.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
