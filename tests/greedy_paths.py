"""Comparing greedy runs: shared token prefixes and the distance of their logprobs, and a
bf16 CUDA engine's greedy tokens with their own logprobs (the GPU tests' yardsticks)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvscale.server import LLM, SamplingParams

MAX_TOKENS = 24  # each GPU test's greedy length


def common_prefix(x: list[int], y: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def common_prefixes(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens two runs share."""
    return [common_prefix(x, y) for x, y in zip(a, b, strict=True)]


def mean_common_prefix(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean over prompts of how many leading tokens two runs share."""
    return sum(common_prefixes(a, b)) / len(a)


def logprob_distance(a: list[list[float]], b: list[list[float]], n: list[int]) -> float:
    """Mean absolute difference of two runs' token logprobs over each prompt's first
    ``n[i]`` tokens."""
    pairs = [(x, y) for i, m in enumerate(n) for x, y in zip(a[i][:m], b[i][:m], strict=True)]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


def greedy_logprobs(
    path: Path, prompts: list[list[int]], before: Callable[[Any], None] | None = None, **kw: Any
) -> tuple[list[list[int]], list[list[float]]]:
    """bf16 greedy tokens on CUDA (Triton attention) and each token's own logprob, per
    prompt. ``before(llm)`` runs ahead of generating (to inspect the engine or install a
    recorder); the engine and its GPU memory are released before returning."""
    llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend="triton", **kw)
    if before is not None:
        before(llm)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, sp)
    llm.engine.core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs
