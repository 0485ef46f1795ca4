"""bench/schedule_model.py (NOTES e82): the scheduler replay and its cost model."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench

sm = load_bench("schedule_model")
eb = load_bench("engine_bench")

FREE = sm.StepCost(weights_s=0.0, token_s=0.0, kv_s=0.0, overhead_s=1.0)  # 1 s a step


def test_a_prompt_over_the_budget_is_prefilled_in_chunks_then_decoded_a_token_a_step() -> None:
    r = sm.simulate([(10, 2)], max_num_seqs=1, budget=4, cost=FREE)
    assert (r["steps"], r["prefill_steps"]) == (5, 3)  # 4 + 4 + 2 prompt tokens, 2 outputs
    assert r["seconds"] == 5.0 and r["output_tok_per_s"] == pytest.approx(2 / 5)


def test_max_num_seqs_holds_requests_back_until_one_finishes() -> None:
    two = [(2, 2), (2, 2)]
    assert sm.simulate(two, max_num_seqs=1, budget=8, cost=FREE)["steps"] == 6
    assert sm.simulate(two, max_num_seqs=2, budget=8, cost=FREE)["steps"] == 3


def test_running_sequences_take_the_budget_in_arrival_order() -> None:
    # the first request decodes while the second's prompt gets what is left of 4 tokens
    r = sm.simulate([(2, 3), (6, 1)], max_num_seqs=2, budget=4, cost=FREE)
    # step 1: prompt 1 (2 tokens) and 2 of prompt 2; step 2: a decode and 3 of prompt 2;
    # step 3: a decode and prompt 2's last; step 4: both decode, both end
    assert (r["steps"], r["prefill_steps"]) == (4, 3)


def test_a_step_costs_the_longer_of_weights_and_matmuls_plus_its_kv_reads() -> None:
    c = sm.StepCost(weights_s=5.0, token_s=0.01, kv_s=0.001, overhead_s=0.5)
    assert c(100, 1000) == pytest.approx(5.0 + 1.0 + 0.5)  # weights-bound
    assert c(1000, 0) == pytest.approx(10.0 + 0.5)  # matmul-bound


def test_b_takes_the_steps_r89_and_r90_measured() -> None:
    lengths = eb.b_lengths()
    steps = {n: sm.simulate(lengths, n, budget=8192, cost=FREE) for n in (256, 512, 1024)}
    assert (steps[256]["steps"], steps[256]["prefill_steps"]) == (1512, 402)  # r89, r90: 1,511, 402
    assert (steps[512]["steps"], steps[512]["prefill_steps"]) == (1196, 174)  # r90: 1,195, 174
    assert (steps[1024]["steps"], steps[1024]["prefill_steps"]) == (1049, 26)  # r90: 1,048, 26


def test_the_8b_costs_follow_its_published_size() -> None:
    c = sm.StepCost.for_model(eb.LLAMA_31_8B, copy_bytes_per_s=3e12, flop_per_s=760e12)
    # Llama 3.1 8B: 8,030,261,248 parameters, 525,336,576 of them the embedding table (read
    # by a gather, not a step); the KV cache 32 layers x 8 heads x 128 x (K, V) x 2 bytes
    assert c.weights_s == pytest.approx((8_030_261_248 - 525_336_576) * 2 / 3e12)
    assert c.kv_s == pytest.approx(32 * 8 * 128 * 2 * 2 / 3e12)
    # every matmul but the embedding's: the layers' and the head's, 2 FLOP a weight
    matmul_params = 8_030_261_248 - 525_336_576 - 4096 * 65  # less the 65 RMSNorms' weights
    assert c.token_s == pytest.approx(2 * matmul_params / (0.78 * 760e12))
