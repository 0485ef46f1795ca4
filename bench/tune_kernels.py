"""Sweeps launch configurations of the attention kernels on one CUDA GPU (device tool).

Prints, for split-KV decode (B=1, context 32768), causal prefill (8 x 2048), the
prefill kernel's small tiles on decode rows (workload B's mixed steps: 250 rows of 200-1,500
tokens of context) and the decode kernel at large batches (``batch``: A's 256 rows of 520
tokens in bf16 and with an FP8 cache, and B's 250 rows), the time and achieved bandwidth /
TFLOP/s of each configuration, best first. The kernels' default configs are then set from
what this finds (bench/NOTES.md keeps the numbers).

    python bench/tune_kernels.py [--only short,batch]
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb

Row = tuple[float, str]  # (ms, config label)


def label_of(cfg: dict[str, int]) -> str:
    """``BLOCK_N=64 num_warps=4 ...``: a config as the sweeps print it."""
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def median_ms(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in ms (Triton's ``do_bench``: 25 ms warm-up, 100 ms timed)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def sweep(
    module: Any,
    attr: str,
    configs: Iterable[dict[str, int]],
    call: Callable[[], object],
    timer: Callable[[Callable[[], object]], float] = median_ms,
) -> list[Row]:
    """Times ``call`` with ``module.attr`` (a kernel's config function) answering each of
    ``configs`` in turn, then restores it. Returns (ms, label) rows, fastest first; a config
    that fails to compile or launch is printed and left out."""
    orig = getattr(module, attr)
    rows: list[Row] = []
    try:
        for cfg in configs:
            setattr(module, attr, lambda *_a, cfg=cfg, **_k: cfg)
            label = label_of(cfg)
            try:
                rows.append((timer(call), label))
            except Exception as e:
                print(f"{attr} {label}: {type(e).__name__}")
    finally:
        setattr(module, attr, orig)
    return sorted(rows)


def grid(**axes: Iterable[int]) -> list[dict[str, int]]:
    """Every combination of the named axes, as config dicts."""
    keys = list(axes)
    return [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*axes.values())]


def show(rows: list[Row], rate: Callable[[float], str], default: str | None = None) -> None:
    """Prints the 12 fastest rows (and the default's, marked, wherever it ranks)."""
    shown = rows[:12] + [r for r in rows[12:] if r[1] == default]
    for t, label in shown:
        mark = " (default)" if label == default else ""
        print(f"{t * 1e3:8.1f} us  {rate(t):>12}  {label}{mark}")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode,prefill,short", help="comma list of sweeps")
    only = ap.parse_args().only.split(",")
    if "decode" in only:
        sweep_split_decode()
    if "prefill" in only:
        sweep_prefill()
    if "short" in only:
        sweep_short()
    if "batch" in only:
        sweep_batch_decode()


def sweep_split_decode() -> None:
    """Split-KV decode at batch 1 and 32,768 tokens of context: splits x tile x launch."""
    from kvscale.kernels import paged_decode as pd
    from kvscale.kernels.testing import random_paged_kv

    dev, dt, ctx = torch.device("cuda"), torch.bfloat16, 32768
    kv = random_paged_kv([ctx], kb.NUM_KV_HEADS, kb.HEAD_DIM, 16, dt, dev, garbage=None)
    q = torch.randn(1, kb.NUM_HEADS, kb.HEAD_DIM, dtype=dt, device=dev)
    nbytes = kb.decode_bytes(1, ctx, kb.NUM_HEADS, kb.NUM_KV_HEADS, kb.HEAD_DIM, 2)
    rows: list[Row] = []
    for splits in (16, 33, 64, 128, 256):
        call = functools.partial(
            pd.paged_decode_attention,
            q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.088, num_splits=splits,
        )  # fmt: skip
        configs = grid(BLOCK_N=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(2, 3, 4))
        timed = sweep(pd, "decode_config", configs, call)
        rows += [(t, f"splits={splits} {label}") for t, label in timed]
    print("--- split-KV decode, batch 1, 32,768 tokens")
    show(sorted(rows), lambda t: f"{nbytes / t / 1e6:.0f} GB/s")


def sweep_prefill() -> None:
    """Causal prefill of 8 x 2,048 tokens: tile sizes x launch options."""
    from kvscale.kernels import paged_prefill as pp
    from kvscale.kernels.testing import random_paged_kv

    dev, dt, lens = torch.device("cuda"), torch.bfloat16, [2048] * 8
    kv = random_paged_kv(lens, kb.NUM_KV_HEADS, kb.HEAD_DIM, 16, dt, dev, garbage=None)
    q = torch.randn(sum(lens), kb.NUM_HEADS, kb.HEAD_DIM, dtype=dt, device=dev)
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    flops = kb.prefill_flops(lens, kb.NUM_HEADS, kb.HEAD_DIM)
    call = functools.partial(
        pp.paged_prefill_attention,
        q, kv.k_cache, kv.v_cache, qsl, kv.seq_lens, kv.block_tables, 2048, 0.088,
    )  # fmt: skip
    configs = grid(
        BLOCK_M=(64, 128, 256), BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4)
    )
    print("--- causal prefill, 8 x 2,048 tokens")
    show(sweep(pp, "prefill_config", configs, call), lambda t: f"{flops / t / 1e9:.0f} TFLOP/s")


def sweep_short() -> None:
    """The small-tile configs of ``paged_prefill.short_config`` on B-shaped decode rows."""
    from kvscale.kernels import paged_prefill as pp

    ctx = kb.b_decode_contexts()
    kv, q, qsl = kb.varlen_batch(ctx, [1] * len(ctx), torch.bfloat16, torch.device("cuda"))
    nbytes = 2 * sum(ctx) * kb.NUM_KV_HEADS * kb.HEAD_DIM * 2
    call = functools.partial(
        pp.paged_prefill_attention,
        q, kv.k_cache, kv.v_cache, qsl, kv.seq_lens, kv.block_tables, 1, 0.088,
    )  # fmt: skip
    configs = grid(BLOCK_M=(16,), BLOCK_N=(32, 64, 128), num_warps=(2, 4, 8), num_stages=(2, 3, 4))
    print("--- the prefill kernel's small tiles on B's decode rows")
    show(sweep(pp, "short_config", configs, call), lambda t: f"{nbytes / t / 1e6:.0f} GB/s")


def sweep_batch_decode() -> None:
    """The decode kernel's tile and launch options at large batches, where every sequence
    has a program of its own per KV head (no split): A's decode step (256 rows after
    512-token prompts, bf16 and an FP8 cache) and B's decode rows. The default config's
    row is marked; each case's bandwidth counts K and V read once."""
    from kvscale.kernels import paged_decode as pd
    from kvscale.kernels.testing import random_paged_kv

    dev = torch.device("cuda")
    cases = [("A 256x520", [520] * 256, False), ("A 256x520", [520] * 256, True),
             ("B decode rows", kb.b_decode_contexts(), False)]  # fmt: skip
    for name, ctx, fp8 in cases:
        kv = random_paged_kv(
            ctx, kb.NUM_KV_HEADS, kb.HEAD_DIM, 16, torch.bfloat16, dev, garbage=None
        )
        k, v, elem, scale = kv.k_cache, kv.v_cache, 2, None
        if fp8:
            k, v, elem = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), 1
            scale = torch.tensor(1.0, device=dev)
        q = torch.randn(len(ctx), kb.NUM_HEADS, kb.HEAD_DIM, dtype=torch.bfloat16, device=dev)
        nbytes = 2 * sum(ctx) * kb.NUM_KV_HEADS * kb.HEAD_DIM * elem
        call = functools.partial(
            pd.paged_decode_attention,
            q, k, v, kv.block_tables, kv.seq_lens, 0.088,
            num_splits=1, k_scale=scale, v_scale=scale,
        )  # fmt: skip
        configs = grid(BLOCK_N=(16, 32, 64, 128), num_warps=(2, 4, 8), num_stages=(1, 2, 3, 4))
        default = label_of(pd.decode_config(kb.HEAD_DIM, 16, fp8))
        print(
            f"--- decode at large batch: {name}, {'fp8' if fp8 else 'bf16'} cache, "
            f"{nbytes / 1e9:.2f} GB of K/V"
        )
        rows = sweep(pd, "decode_config", configs, call)
        show(rows, lambda t, n=nbytes: f"{n / t / 1e6:.0f} GB/s", default)


if __name__ == "__main__":
    main()
