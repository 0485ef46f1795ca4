"""The in-kernel split-KV merge (``KVSCALE_DECODE_MERGE``, NOTES e61) against the reduce
kernel, launch after launch on a GPU: which one differs, by how much, and whether the
merge gives the same bits for the same inputs (its arithmetic is the reduce kernel's, so
launches that differ for one q point at partials read before they were visible).

    python bench/merge_check.py --out merge_check.json [--launches 200]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvscale.kernels import paged_decode
from kvscale.kernels.paged_decode import paged_decode_attention
from kvscale.kernels.testing import random_paged_kv

CASES = {  # name: (seq_lens, kv_heads, group, head_dim, splits)
    "b1-300-s16": ([300], 8, 4, 128, 16),
    "b1-4000-s16": ([4000], 8, 4, 128, 16),
    "b8-mixed-s7": ([700, 20, 1500, 3, 999, 64, 2048, 300], 8, 4, 128, 7),
}


def _launch(args: tuple, splits: int, merge: bool) -> torch.Tensor:
    paged_decode.USE_MERGE_IN_KERNEL = merge
    out = torch.full_like(args[0], float("nan"))
    return paged_decode_attention(*args, out=out, num_splits=splits)


def check(case: str, dtype: torch.dtype, launches: int, device: torch.device) -> dict:
    """``launches`` new q's: merge vs reduce bits, and the merge run 3 times on each q."""
    seq_lens, kv_heads, group, head_dim, splits = CASES[case]
    kv = random_paged_kv(seq_lens, kv_heads, head_dim, 16, dtype, device)
    differ = unstable = 0
    worst_ulps = 0.0
    rows_differing: list[int] = []
    for _ in range(launches):
        q = torch.randn(len(seq_lens), kv_heads * group, head_dim, dtype=dtype, device=device)
        args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, head_dim**-0.5)
        merged = [_launch(args, splits, True) for _ in range(3)]
        ref = _launch(args, splits, False)
        if not all(torch.equal(m, merged[0]) for m in merged[1:]):
            unstable += 1
        if not torch.equal(merged[0], ref):
            differ += 1
            bad = (merged[0] != ref).any(dim=-1)  # [B, Hq]
            rows_differing.append(int(bad.sum()))
            ulp = ref.float().abs().clamp_min(1e-3) * torch.finfo(dtype).eps
            worst_ulps = max(worst_ulps, float(((merged[0] - ref).float().abs() / ulp).max()))
    paged_decode.USE_MERGE_IN_KERNEL = False
    return {"case": case, "dtype": str(dtype), "launches": launches,
            "merge_differs_from_reduce": differ, "merge_differs_across_3_runs": unstable,
            "worst_diff_in_output_eps": worst_ulps,
            "heads_differing_per_bad_launch": rows_differing[:20]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    rows = []
    for case in a.cases.split(","):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            rows.append(check(case, dtype, a.launches, torch.device(a.device)))
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    meta = {"gpu": gpu, "torch": torch.__version__}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
