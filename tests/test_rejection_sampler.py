"""The speculative-decoding rejection sampler on synthetic distributions: the emitted
tokens follow the target's distribution (not the draft's), greedy keeps the argmax, seeded
rows reproduce."""

from __future__ import annotations

import pytest
import torch

from kvscale.server.layers.sampler import apply_top_k_top_p_min_p, row_seed, seeded_generators
from kvscale.server.spec_decode.rejection_sampler import PAD, greedy_verify, rejection_sample

V = 8
K = 3


def _target(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The target's distribution after temperature and top-p, as the normal sampler does."""
    x = logits / temperature
    n = x.shape[0]
    apply_top_k_top_p_min_p(x, None, torch.full((n,), top_p), None)
    return torch.softmax(x, dim=-1)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def _stream(
    p: torch.Tensor, q: torch.Tensor | None, n: int, length: int, gen: torch.Generator
) -> torch.Tensor:
    """Runs ``n`` sequences of verify steps until each has ``length`` tokens. The target's
    distribution at stream index ``t`` is ``p[t]`` (``q[t]`` the draft's; None: the draft
    proposes a fixed token, point mass). Returns ``[n, length]`` tokens."""
    horizon = length + K + 1
    out = torch.full((n, horizon), PAD, dtype=torch.int64)
    have = torch.zeros(n, dtype=torch.int64)
    rows = torch.arange(n)
    while bool((have < length).any()):
        pos = have.unsqueeze(1) + torch.arange(K + 1)  # [n, K+1]
        tp = p[pos.clamp(max=p.shape[0] - 1)]  # [n, K+1, V]
        if q is None:
            drafts = (pos[:, :K] * 3 + 1) % V  # an arbitrary deterministic guess
            dp = None
        else:
            dp = q[pos[:, :K].clamp(max=q.shape[0] - 1)]
            drafts = torch.multinomial(dp.reshape(-1, V), 1, generator=gen).view(n, K)
        num = torch.full((n,), K, dtype=torch.int64)
        res = rejection_sample(
            tp, drafts, num, torch.zeros(n, dtype=torch.bool), default=gen, draft_probs=dp
        )
        emitted = torch.where(have < length, res.num_accepted + 1, 0)
        for j in range(K + 1):
            m = j < emitted
            out[rows[m], (have + j)[m]] = res.tokens[m, j]
        assert bool((res.tokens[:, :K][res.accepted_mask] == drafts[res.accepted_mask]).all())
        have += emitted
    return out[:, :length]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (1.0, 0.5)])
@pytest.mark.parametrize("point_mass", [False, True])
def test_output_follows_target_not_draft(temperature: float, top_p: float, point_mass: bool):
    gen = torch.Generator().manual_seed(1234)
    length = 5
    tl = torch.randn(length + K + 1, V, generator=gen) * 1.5
    dl = torch.randn(length + K + 1, V, generator=gen) * 1.5
    p = _target(tl, temperature, top_p)
    q = None if point_mass else torch.softmax(dl, dim=-1)
    errors = []
    for n in (2_000, 40_000):
        out = _stream(p, q, n, length, gen)
        err = 0.0
        for t in range(length):
            emp = torch.bincount(out[:, t], minlength=V).double() / n
            err = max(err, _tv(emp, p[t].double()))
            if q is not None and _tv(p[t], q[t]) > 0.15:
                # and it is not the draft's: far further from q than the sampling error
                assert _tv(emp, q[t].double()) > _tv(p[t], q[t]) - 0.03
        errors.append(err)
    # TV of an 8-bin histogram of 40k samples: ~0.01; 2k: ~0.04
    assert errors[-1] < 0.025, errors
    assert errors[-1] < errors[0] or errors[0] < 0.025, errors


def test_acceptance_rate_matches_theory():
    """Accepting position 0 has probability sum_x min(p, q)."""
    gen = torch.Generator().manual_seed(7)
    n = 50_000
    p = torch.softmax(torch.randn(V, generator=gen), -1)
    q = torch.softmax(torch.randn(V, generator=gen), -1)
    tp = p.expand(n, K + 1, V).contiguous()
    dp = q.expand(n, K, V).contiguous()
    drafts = torch.multinomial(dp.reshape(-1, V), 1, generator=gen).view(n, K)
    res = rejection_sample(
        tp,
        drafts,
        torch.full((n,), K),
        torch.zeros(n, dtype=torch.bool),
        default=gen,
        draft_probs=dp,
    )
    rate = res.accepted_mask[:, 0].double().mean().item()
    assert abs(rate - torch.minimum(p, q).sum().item()) < 0.01


def test_greedy_accepts_only_argmax_and_emits_argmax():
    tp = torch.tensor(
        [[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]]]
    ).repeat(3, 1, 1)
    drafts = torch.tensor([[1, 0, 2], [1, 1, 2], [0, 0, 2]])
    res = rejection_sample(tp, drafts, torch.tensor([3, 3, 3]), torch.ones(3, dtype=torch.bool))
    assert res.num_accepted.tolist() == [3, 1, 0]
    assert res.tokens.tolist() == [[1, 0, 2, 2], [1, 0, PAD, PAD], [1, PAD, PAD, PAD]]


def test_greedy_verify_equals_rejection_sampling_of_greedy_rows():
    """The all-greedy shortcut (argmax only) gives rejection sampling's output exactly:
    tokens, accepted counts and per-position mask, for drafts of every length."""
    g = torch.Generator().manual_seed(5)
    n, k, vocab = 64, 4, 6  # a small vocabulary: drafts often match the argmax
    tp = torch.rand(n, k + 1, vocab, generator=g).softmax(-1)
    argmax = tp.argmax(-1)
    drafts = torch.where(
        torch.rand(n, k, generator=g) < 0.7,
        argmax[:, :k],
        torch.randint(0, vocab, (n, k), generator=g),
    )
    num_draft = torch.randint(0, k + 1, (n,), generator=g)
    want = rejection_sample(tp, drafts, num_draft, torch.ones(n, dtype=torch.bool))
    got = greedy_verify(drafts, num_draft, argmax)
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.num_accepted.tolist() == want.num_accepted.tolist()
    assert torch.equal(got.accepted_mask, want.accepted_mask)
    assert set(want.num_accepted.tolist()) == set(range(k + 1))  # every length occurs


def test_short_drafts_and_zero_drafts():
    tp = torch.tensor([[[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]]).repeat(2, 1, 1)
    drafts = torch.tensor([[1, 2], [2, 2]])  # row 0 drafts 1 token, row 1 none
    res = rejection_sample(tp, drafts, torch.tensor([1, 0]), torch.ones(2, dtype=torch.bool))
    assert res.num_accepted.tolist() == [1, 0]
    assert res.tokens.tolist() == [[1, 0, PAD], [1, PAD, PAD]]


def test_point_mass_rejects_impossible_token_and_never_resamples_it():
    gen = torch.Generator().manual_seed(0)
    n = 2000
    tp = torch.tensor([0.5, 0.5, 0.0]).expand(n, 2, 3).contiguous()

    def verify(token: int):  # every row drafts ``token`` with a point-mass proposal
        drafts = torch.full((n, 1), token, dtype=torch.int64)
        ones, sampled = torch.ones(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool)
        return rejection_sample(tp, drafts, ones, sampled, default=gen)

    res = verify(2)
    assert int(res.num_accepted.sum()) == 0
    assert set(res.tokens[:, 0].tolist()) == {0, 1}
    res = verify(0)
    # accepted with probability p(0) = 0.5; a rejection resamples from p without token 0
    assert abs(res.accepted_mask[:, 0].double().mean().item() - 0.5) < 0.05
    assert bool((res.tokens[~res.accepted_mask[:, 0], 0] == 1).all())


def test_seeded_rows_reproduce_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    n = 6
    tp = torch.softmax(torch.randn(n, K + 1, 50, generator=gen), -1)
    dp = torch.softmax(torch.randn(n, K, 50, generator=gen), -1)
    drafts = torch.multinomial(dp.reshape(-1, 50), 1, generator=gen).view(n, K)
    seeds = [row_seed(11, 4), None, row_seed(12, 0), None, row_seed(13, 9), row_seed(14, 2)]

    def run(default_seed: int, order: list[int]):
        o = torch.tensor(order)
        sd = [seeds[i] for i in order]
        return rejection_sample(
            tp[o],
            drafts[o],
            torch.full((n,), K),
            torch.zeros(n, dtype=torch.bool),
            seeded_generators(sd, torch.device("cpu")),
            torch.Generator().manual_seed(default_seed),
            draft_probs=dp[o],
        ).tokens

    a = run(1, list(range(n)))
    b = run(2, list(range(n)))
    rev = list(reversed(range(n)))
    c = run(3, rev)
    for i, s in enumerate(seeds):
        if s is not None:
            assert a[i].tolist() == b[i].tolist() == c[rev.index(i)].tolist()
