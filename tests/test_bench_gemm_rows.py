"""CPU tests of bench/gemm_rows.py: its variants compute the same product (no GPU), and
its results writer shared by the host-cost scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.bench_scripts import load_bench

gr = load_bench("gemm_rows")


@pytest.mark.parametrize("m", [1, 4])
def test_every_variant_computes_x_times_w_transposed(m: int) -> None:
    x, w = torch.randn(m, 64), torch.randn(48, 64)
    want = x @ w.t()
    for name, fn in gr.VARIANTS.items():
        if gr.applies(name, m, 64):
            got = fn(x, w)
            split = name.startswith("split") and "+sum" not in name
            assert got.shape == ((int(name[5]), m, 48) if split else (m, 48)), name
            torch.testing.assert_close(gr.result(got), want, msg=name)
    assert gr.applies("mv", 1, 64) and not gr.applies("mv", 4, 64)
    assert gr.applies("split4f", 1, 64) and not gr.applies("split3", 1, 64)


def test_tp2_shapes_halve_each_rank_s_share() -> None:
    full = {name: (n, k) for name, n, k in gr.shapes("8b")}
    for name, n, k in gr.shapes("tp2"):
        columns = name in ("qkv", "gate_up", "head")
        assert (n, k) == ((full[name][0] // 2, k) if columns else (n, full[name][1] // 2))


def test_each_graph_cycles_through_over_four_l2s_of_weights() -> None:
    l2 = 50 * 2**20
    assert gr.copies_for(4096 * 4096 * 2, l2) == 7  # o_proj: 7 x 33.5 MB > 200 MB
    assert gr.copies_for(128256 * 4096 * 2, l2) == 2  # the head: at least two
    for _, n, k in gr.LAYERS:
        assert gr.copies_for(n * k * 2, l2) * n * k * 2 >= gr.L2_MULTIPLE * l2


def test_results_are_written_with_their_meta(tmp_path: Path) -> None:
    path = gr.write_results(tmp_path / "out", "x.json", {"gpu": "g"}, [{"us": 1.5}])
    assert path == tmp_path / "out" / "x.json"
    assert json.loads(path.read_text()) == {"meta": {"gpu": "g"}, "results": [{"us": 1.5}]}
