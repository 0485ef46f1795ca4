"""bench/fp8_accuracy.py on the CPU: its metrics on known inputs, and a whole run on a tiny
checkpoint (the GPU run uses the 8B-shaped one)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.bench_scripts import load_bench

fa = load_bench("fp8_accuracy")


def test_kl_and_top1_on_known_distributions() -> None:
    p = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    assert fa.kl_and_top1(p, p) == (0.0, 2)
    q = torch.log_softmax(torch.tensor([[1.0, 2.0, 0.0], [0.0, 0.0, 3.0]]), -1)
    kl, agree = fa.kl_and_top1(p, q)
    expect = float((p[0].exp() * (p[0] - q[0])).sum())
    assert agree == 1 and abs(kl - expect) < 1e-6 and kl > 0


def test_sequences_cover_the_positions_asked_for() -> None:
    seqs = fa.sequences(list(range(10)), 4, 25)
    assert [len(s) for s in seqs] == [4] * 6 + [1]
    assert seqs[2] == [8, 9, 0, 1]  # the text repeats when too short
    assert "kvscale" in fa.text_corpus()


def test_a_whole_run_on_a_tiny_checkpoint(llama_ckpt: Path) -> None:
    res = fa.evaluate(str(llama_ckpt), "cpu", "float32", num_tokens=96, seq_len=48)
    assert res["meta"]["positions"] == 96 and res["meta"]["sequences"] == 2
    weights, both = res["fp8_weights"], res["fp8_weights_kv"]
    assert both["kv_cache_dtype"] == "torch.float8_e4m3fn"
    assert weights["kv_cache_dtype"] == "torch.float32"
    for r in (weights, both):
        # a random tiny model's next-token distributions are nearly flat, so near ties
        # abound: agreement is far above chance (1 in 32,000), far below a real model's
        assert 0 < r["mean_kl_nats"] < 0.05 and 0.3 <= r["top1_agreement"] <= 1
    assert abs(weights["nll"] - res["reference"]["nll"]) < 0.2
