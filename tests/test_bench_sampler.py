"""CPU tests of bench/sampler_bench.py: each setting samples as it says, and the script
writes a row per (rows, setting) (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.bench_scripts import load_bench

sb = load_bench("sampler_bench")


def test_each_setting_samples_what_it_names() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 500, generator=gen) * 4).to(torch.bfloat16)
    greedy = sb.sampling_step(logits, sb.SETTINGS["argmax"], gen)
    assert torch.equal(greedy, logits.float().argmax(dim=-1))
    top50 = logits.float().topk(50, dim=-1).indices
    for _ in range(20):
        tokens = sb.sampling_step(logits, sb.SETTINGS["top_k_top_p"], gen)
        assert (top50 == tokens[:, None]).any(dim=-1).all()
    # the k-th logit by partial selection or by a sort: the same tokens for the same noise
    by_select = sb.sampling_step(logits, sb.SETTINGS["top_k_top_p"], torch.manual_seed(5))
    by_sort = sb.sampling_step(logits, sb.SETTINGS["top_k_top_p_sort"], torch.manual_seed(5))
    assert torch.equal(by_select, by_sort)
    every = sb.sampling_step(logits, sb.SETTINGS["every"], gen)  # penalties may reorder
    assert every.shape == (6,) and ((every >= 0) & (every < 500)).all()
    # temperature alone reaches beyond the top 50 of a flat enough row
    flat = torch.zeros(1, 500, dtype=torch.bfloat16)
    seen = {sb.sampling_step(flat, sb.SETTINGS["temperature"], gen).item() for _ in range(30)}
    assert len(seen) > 20


def test_the_script_writes_every_rows_and_setting(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--rows", "1,3", "--vocab", "300", "--reps", "2"]
    assert sb.main([*argv, "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "sampler_bench.json").read_text())
    got = {(r["rows"], r["setting"]) for r in res["results"]}
    assert got == {(n, s) for n in (1, 3) for s in sb.SETTINGS}
    assert all(r["ms"] > 0 for r in res["results"])
