"""Verify-step probabilities are exactly what normal sampling draws from at each position."""

from __future__ import annotations

import torch

from kvscale.server.layers.sampler import SamplingTensors, draw, sample, seeded_generators
from kvscale.server.spec_decode.verify_probs import (
    expand_rows,
    verify_output_counts,
    verify_probs,
)

V = 30


def _tensors(n: int, penalties: bool) -> SamplingTensors:
    return SamplingTensors(
        temperature=torch.linspace(0.5, 1.5, n),
        top_k=torch.tensor([0, 5, 10][:n] + [0] * max(0, n - 3)),
        top_p=torch.linspace(0.6, 1.0, n),
        min_p=torch.linspace(0.0, 0.1, n),
        greedy=torch.tensor([False] * (n - 1) + [True]),
        repetition_penalty=torch.full((n,), 1.3 if penalties else 1.0),
        presence_penalty=torch.full((n,), 0.4 if penalties else 0.0),
        frequency_penalty=torch.full((n,), 0.2 if penalties else 0.0),
        do_top_k=True,
        do_top_p_min_p=True,
        do_penalties=penalties,
    )


def test_counts_add_the_drafts_before_each_position():
    counts = torch.zeros(2, 5, dtype=torch.int64)
    counts[0, 4] = 1
    drafts = torch.tensor([[1, 1], [2, 3]])
    out = verify_output_counts(counts, drafts, torch.tensor([2, 1])).view(2, 3, 5)
    assert out[0].tolist() == [[0, 0, 0, 0, 1], [0, 1, 0, 0, 1], [0, 2, 0, 0, 1]]
    assert out[1].tolist() == [[0] * 5, [0, 0, 1, 0, 0], [0, 0, 1, 0, 0]]  # 1 real draft


def test_each_position_draws_what_normal_sampling_draws():
    gen = torch.Generator().manual_seed(0)
    n, k = 3, 2
    for penalties in (False, True):
        t = _tensors(n, penalties)
        logits = torch.randn(n, k + 1, V, generator=gen) * 3
        prompt_mask = torch.rand(n, V, generator=gen) < 0.2
        counts = torch.randint(0, 2, (n, V), generator=gen)
        drafts = torch.randint(0, V, (n, k), generator=gen)
        num = torch.tensor([2, 1, 2])
        vcounts = verify_output_counts(counts, drafts, num)
        probs, greedy = verify_probs(
            logits.reshape(-1, V).clone(),
            expand_rows(t, k + 1),
            prompt_mask.repeat_interleave(k + 1, 0),
            vcounts,
        )
        for j, trial in ((j, trial) for j in range(k + 1) for trial in range(20)):
            rows = torch.arange(n) * (k + 1) + j
            seeds = [101 + i * 7 + j * 1000 + trial * 31 for i in range(n)]
            tok = sample(
                logits[:, j].clone(),
                t,
                seeded_generators(seeds, torch.device("cpu")),
                None,
                prompt_mask,
                vcounts[rows],
            )
            mine = draw(probs[rows], seeded_generators(seeds, torch.device("cpu")), None)
            mine = torch.where(t.greedy, greedy[rows], mine)
            assert tok.tolist() == mine.tolist()
