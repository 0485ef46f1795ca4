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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as kb


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="decode,prefill,short", help="comma list of sweeps")
    only = ap.parse_args().only.split(",")
    if "short" in only:
        sweep_short()
    if "batch" in only:
        sweep_batch_decode()
    if not {"decode", "prefill"} & set(only):
        return
    import triton.testing

    from kvscale.kernels import paged_decode as pd
    from kvscale.kernels import paged_prefill as pp
    from kvscale.kernels.testing import random_paged_kv

    dev, dt = torch.device("cuda"), torch.bfloat16

    def ms(fn: object) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    # --- split-KV decode
    ctx = 32768
    kv = random_paged_kv([ctx], kb.NUM_KV_HEADS, kb.HEAD_DIM, 16, dt, dev, garbage=None)
    q = torch.randn(1, kb.NUM_HEADS, kb.HEAD_DIM, dtype=dt, device=dev)
    nbytes = kb.decode_bytes(1, ctx, kb.NUM_HEADS, kb.NUM_KV_HEADS, kb.HEAD_DIM, 2)
    rows = []
    orig = pd.decode_config
    for splits, bn, warps, stages in itertools.product(
        [16, 33, 64, 128, 256], [32, 64, 128], [2, 4, 8], [2, 3, 4]
    ):
        pd.decode_config = lambda h, b, *_, bn=bn, w=warps, s=stages: {
            "BLOCK_N": bn,
            "num_warps": w,
            "num_stages": s,
        }
        try:

            def fn(sp=splits):
                return pd.paged_decode_attention(
                    q,
                    kv.k_cache,
                    kv.v_cache,
                    kv.block_tables,
                    kv.seq_lens,
                    0.088,
                    num_splits=sp,
                )

            t = ms(fn)
        except Exception as e:
            print(f"decode splits={splits} BN={bn} w={warps} s={stages}: {type(e).__name__}")
            continue
        rows.append(
            (
                t,
                f"decode splits={splits} BLOCK_N={bn} warps={warps} stages={stages}",
                f"{nbytes / t / 1e6:.0f} GB/s",
            )
        )
    pd.decode_config = orig
    for r in sorted(rows)[:12]:
        print(f"{r[0] * 1e3:8.1f} us  {r[2]:>10}  {r[1]}")

    # --- prefill
    lens = [2048] * 8
    kv = random_paged_kv(lens, kb.NUM_KV_HEADS, kb.HEAD_DIM, 16, dt, dev, garbage=None)
    total = sum(lens)
    q = torch.randn(total, kb.NUM_HEADS, kb.HEAD_DIM, dtype=dt, device=dev)
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    flops = kb.prefill_flops(lens, kb.NUM_HEADS, kb.HEAD_DIM)
    rows = []
    orig_p = pp.prefill_config
    for bm, bn, warps, stages in itertools.product(
        [64, 128, 256], [32, 64, 128], [4, 8], [2, 3, 4]
    ):
        pp.prefill_config = lambda h, g, e=2, bm=bm, bn=bn, w=warps, s=stages: {
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "num_warps": w,
            "num_stages": s,
        }
        try:
            fn = lambda: pp.paged_prefill_attention(  # noqa: E731
                q, kv.k_cache, kv.v_cache, qsl, kv.seq_lens, kv.block_tables, 2048, 0.088
            )
            t = ms(fn)
        except Exception as e:
            print(f"prefill BM={bm} BN={bn} w={warps} s={stages}: {type(e).__name__}")
            continue
        rows.append(
            (
                t,
                f"prefill BLOCK_M={bm} BLOCK_N={bn} warps={warps} stages={stages}",
                f"{flops / t / 1e9:.0f} TFLOP/s",
            )
        )
    pp.prefill_config = orig_p
    for r in sorted(rows)[:12]:
        print(f"{r[0] * 1e3:8.1f} us  {r[2]:>10}  {r[1]}")


def sweep_short() -> None:
    """The small-tile configs of ``paged_prefill.short_config`` on B-shaped decode rows."""
    import triton.testing

    from kvscale.kernels import paged_prefill as pp

    ctx = kb.b_decode_contexts()
    kv, q, qsl = kb.varlen_batch(ctx, [1] * len(ctx), torch.bfloat16, torch.device("cuda"))
    nbytes = 2 * sum(ctx) * kb.NUM_KV_HEADS * kb.HEAD_DIM * 2
    rows = []
    orig = pp.short_config
    for bn, warps, stages in itertools.product([32, 64, 128], [2, 4, 8], [2, 3, 4]):
        pp.short_config = lambda h, g, e=2, bn=bn, w=warps, s=stages: {
            "BLOCK_M": 16,
            "BLOCK_N": bn,
            "num_warps": w,
            "num_stages": s,
        }
        try:
            t = float(
                triton.testing.do_bench(
                    lambda: pp.paged_prefill_attention(
                        q, kv.k_cache, kv.v_cache, qsl, kv.seq_lens, kv.block_tables, 1, 0.088
                    ),
                    warmup=25,
                    rep=100,
                    return_mode="median",
                )
            )
        except Exception as e:
            print(f"short BN={bn} w={warps} s={stages}: {type(e).__name__}")
            continue
        rows.append((t, f"short BLOCK_N={bn} warps={warps} stages={stages}", nbytes / t / 1e6))
    pp.short_config = orig
    for t, name, gbs in sorted(rows)[:12]:
        print(f"{t * 1e3:8.1f} us  {gbs:8.0f} GB/s  {name}")


def sweep_batch_decode() -> None:
    """The decode kernel's tile and launch options at large batches, where every sequence
    has a program of its own per KV head (no split): A's decode step (256 rows after
    512-token prompts, bf16 and an FP8 cache) and B's decode rows. The default config's
    row is marked; each case's bandwidth counts K and V read once."""
    import triton.testing

    from kvscale.kernels import paged_decode as pd
    from kvscale.kernels.testing import random_paged_kv

    dev = torch.device("cuda")
    cases = {"A 256x520": [520] * 256, "B decode rows": kb.b_decode_contexts()}
    orig = pd.decode_config
    for (name, ctx), fp8 in itertools.product(cases.items(), (False, True)):
        if fp8 and not name.startswith("A"):
            continue
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
            q,
            k,
            v,
            kv.block_tables,
            kv.seq_lens,
            0.088,
            num_splits=1,
            k_scale=scale,
            v_scale=scale,
        )
        rows = []
        for bn, warps, stages in itertools.product([16, 32, 64, 128], [2, 4, 8], [1, 2, 3, 4]):
            cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            pd.decode_config = lambda h, b, *_, cfg=cfg: cfg
            try:
                t = float(
                    triton.testing.do_bench(
                        call,
                        warmup=25,
                        rep=100,
                        return_mode="median",
                    )
                )
            except Exception as e:
                print(f"{name} fp8={fp8} {cfg}: {type(e).__name__}")
                continue
            mark = " (default)" if cfg == orig(kb.HEAD_DIM, 16, fp8) else ""
            rows.append((t, f"BLOCK_N={bn} warps={warps} stages={stages}{mark}"))
        pd.decode_config = orig
        print(
            f"--- decode at large batch: {name}, {'fp8' if fp8 else 'bf16'} cache, "
            f"{nbytes / 1e9:.2f} GB of K/V"
        )
        ranked = sorted(rows)
        shown = ranked[:10] + [r for r in ranked[10:] if "(default)" in r[1]]
        for t, label in shown:
            print(f"{t * 1e3:8.1f} us  {nbytes / t / 1e6:8.0f} GB/s  {label}")


if __name__ == "__main__":
    main()
