"""The sampler's pure functions on hand-made distributions."""

from __future__ import annotations

import math

import pytest
import torch

from kvscale.server.layers.sampler import (
    SamplingTensors,
    apply_penalties,
    apply_top_k_top_p_min_p,
    draw,
    sample,
    top_logprobs,
)

PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def _kept(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
    logits = PROBS.log().clone()
    apply_top_k_top_p_min_p(
        logits, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p])
    )
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_top_k_top_p_min_p_masks() -> None:
    assert _kept() == [0, 1, 2, 3]
    assert _kept(top_k=2) == [0, 1]
    assert _kept(top_k=1) == [0]
    assert _kept(top_p=0.7) == [0, 1]
    assert _kept(top_p=0.5) == [0]
    assert _kept(top_p=0.81) == [0, 1, 2]
    assert _kept(top_p=0.01) == [0]  # the top token always stays
    assert _kept(min_p=0.4) == [0, 1]  # threshold 0.2
    assert _kept(min_p=0.25) == [0, 1, 2]
    assert _kept(top_k=3, top_p=0.7) == [0, 1]


def test_top_p_one_keeps_every_token_beside_rows_that_cut() -> None:
    # this sharp row's fp32 cumulative sum reaches 1.0 before its tail: a sort-based cut
    # at top_p 1 dropped 978 of its 1,000 tokens whenever a neighbour set top_p
    row = 12.0 * torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    logits = row.repeat(2, 1)
    apply_top_k_top_p_min_p(logits, None, torch.tensor([0.9, 1.0]), None)
    assert torch.isfinite(logits[1]).all()
    assert 0 < torch.isfinite(logits[0]).sum() < 1000


def test_top_p_keeps_the_ties_of_the_nucleus_last_token() -> None:
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]).log()
    apply_top_k_top_p_min_p(logits, None, torch.tensor([0.5]), None)
    assert torch.isfinite(logits[0]).tolist() == [True, True, True, False, False]


def test_masks_apply_per_row() -> None:
    logits = PROBS.log().repeat(2, 1)
    apply_top_k_top_p_min_p(logits, torch.tensor([1, 0]), None, None)
    assert torch.isfinite(logits).sum(dim=1).tolist() == [1, 4]


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    prompt_mask = torch.tensor([[True, True, False, False]])
    counts = torch.tensor([[0, 0, 3, 0]])
    apply_penalties(
        logits,
        prompt_mask,
        counts,
        torch.tensor([2.0]),
        torch.tensor([0.5]),
        torch.tensor([0.25]),
    )
    # token 0: 2/2; token 1: -2*2; token 2: 1/2 - 0.25*3 - 0.5; token 3 untouched
    assert torch.allclose(logits, torch.tensor([[1.0, -4.0, 0.5 - 0.75 - 0.5, 0.5]]))


def test_seeded_draw_ignores_neighbours() -> None:
    probs = torch.softmax(torch.randn(5, 50), dim=-1)

    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    alone = [draw(probs[2:3], [gen(7)], None).item() for _ in range(1)]
    batch = draw(probs, [None, gen(3), gen(7), None, gen(9)], gen(0))
    assert batch[2].item() == alone[0]


def test_draw_follows_the_distribution() -> None:
    probs = torch.tensor([[0.6, 0.3, 0.1]]).repeat(20000, 1)
    tokens = draw(probs, [None] * 20000, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.02)


def test_greedy_rows_take_argmax_in_mixed_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    t = SamplingTensors(
        temperature=torch.tensor([0.0, 100.0]),
        top_k=torch.tensor([0, 0]),
        top_p=torch.tensor([1.0, 1.0]),
        min_p=torch.tensor([0.0, 0.0]),
        greedy=torch.tensor([True, False]),
        repetition_penalty=torch.ones(2),
        presence_penalty=torch.zeros(2),
        frequency_penalty=torch.zeros(2),
        do_top_k=False,
        do_top_p_min_p=False,
        do_penalties=False,
    )
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits.clone(), t, [None, None], gen)[1].item() for _ in range(50)}
    assert sample(logits.clone(), t, [None, None], gen)[0].item() == 1
    assert len(seen) > 1  # temperature 100 flattens the second row


def test_top_logprobs_ranks() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    ids, lps, s_lp, rank = top_logprobs(logits, torch.tensor([2]), 2)
    assert ids.tolist() == [[1, 2]]
    assert rank.tolist() == [2]
    norm = math.log(sum(math.exp(x) for x in (1.0, 3.0, 2.0, 0.0)))
    assert abs(s_lp.item() - (2.0 - norm)) < 1e-6
    assert abs(lps[0, 0].item() - (3.0 - norm)) < 1e-6


@pytest.mark.parametrize("vocab", [300, 5000])
def test_top_k_by_partial_selection_masks_as_the_full_sort(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    # bf16-rounded logits: many exact ties, some at the k-th value
    logits = (torch.randn(7, vocab, generator=gen) * 2).to(torch.bfloat16).float()
    logits[6] = 1.0  # a row of nothing but ties
    top_k = torch.tensor([1, 5, 50, 0, 40, 50, 3])  # 0: off
    top_p = torch.tensor([1.0, 0.9, 0.8, 0.95, 1.0, 0.5, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.1, 0.0, 0.0])
    top_k_max = 50  # the host's bound: the largest k of the rows that set one
    want = apply_top_k_top_p_min_p(logits.clone(), top_k, top_p, min_p)  # full sort
    got = apply_top_k_top_p_min_p(logits.clone(), top_k, top_p, min_p, top_k_max)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), (got.isinf() != want.isinf()).any(-1)
    kept = torch.isfinite(got).sum(dim=-1)
    assert kept[0] >= 1 and kept[6] == vocab  # ties with the k-th are kept
    assert kept[3] > 50  # the row without top-k is not cut to the bound
