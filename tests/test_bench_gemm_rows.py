"""CPU tests of bench/gemm_rows.py: its variants compute the same product (no GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.bench_scripts import load_bench

gr = load_bench("gemm_rows")


@pytest.mark.parametrize("m", [1, 4])
def test_every_variant_computes_x_times_w_transposed(m: int) -> None:
    x, w = torch.randn(m, 64), torch.randn(48, 64)
    want = x @ w.t()
    for name, fn in gr.VARIANTS.items():
        if gr.applies(name, m):
            got = fn(x, w)
            assert got.shape == (m, 48), name
            torch.testing.assert_close(got, want, msg=name)
    assert gr.applies("mv", 1) and not gr.applies("mv", 4)


def test_each_graph_cycles_through_over_four_l2s_of_weights() -> None:
    l2 = 50 * 2**20
    assert gr.copies_for(4096 * 4096 * 2, l2) == 7  # o_proj: 7 x 33.5 MB > 200 MB
    assert gr.copies_for(128256 * 4096 * 2, l2) == 2  # the head: at least two
    for _, n, k in gr.LAYERS:
        assert gr.copies_for(n * k * 2, l2) * n * k * 2 >= gr.L2_MULTIPLE * l2
