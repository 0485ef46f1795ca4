"""The W4A16 GEMV at the 8B model's four layer shapes, one row, for a profiler to read.

Runs each shape twice (the first call compiles) with GPTQ-layout symmetric weights in
groups of 128, the default config, so Nsight Compute can profile the second calls::

    ncu --clock-control none -k regex:_w4a16_gemv --launch-skip 4 --launch-count 4 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python bench/gemv_profile.py

Prints each call's shape and config.
"""

from __future__ import annotations

import torch

from kvscale.kernels.testing import LLAMA_8B_LINEARS

GROUP = 128


def main() -> int:
    from kvscale.kernels import w4a16

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name, k, n in LLAMA_8B_LINEARS:
        codes = torch.randint(0, 16, (k, n), generator=gen, device="cuda", dtype=torch.uint8)
        scales = torch.rand(k // GROUP, n, generator=gen, device="cuda") * 0.02
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        cases.append((name, x, w4a16.pack_int4_rows(codes), scales))
    for _ in range(2):
        for _name, x, qweight, scales in cases:
            w4a16.w4a16_gemm(x, qweight, scales, None, GROUP)
    torch.cuda.synchronize()
    for name, x, qweight, _scales in cases:
        k, n = x.shape[1], qweight.shape[1]
        cfg = w4a16.w4a16_config(1, n, k, x.device, w4a16.gemv_block_k(GROUP, k // GROUP, False))
        print(f"{name}: K={k} N={n} {cfg}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
