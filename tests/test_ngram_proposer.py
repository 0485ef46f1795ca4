"""The n-gram (prompt lookup) proposers (the vectorised lookup and the engine's incremental
one) against a plain Python reference, and their speed."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from kvscale.server.spec_decode.ngram_proposer import NgramProposer, ngram_lookup
from kvscale.server.spec_decode.proposer import DraftRequest


def _reference(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n_len = len(seq)
    for n in range(min(max_n, n_len - 1), min_n - 1, -1):
        suffix = seq[n_len - n :]
        for end in range(n_len - 2, n - 2, -1):  # most recent first
            if seq[end - n + 1 : end + 1] == suffix:
                period = n_len - 1 - end  # continues periodically past the end
                return [seq[end + 1 + j % period] for j in range(k)]
    return []


def _incremental(seqs, k: int, min_n: int, max_n: int):
    """The engine's proposer, fed each sequence grown a few tokens at a time (as accepted
    tokens arrive); returns its last proposal for each (as ngram_lookup does)."""
    p = NgramProposer(k, min_n, max_n)
    rng = random.Random(len(seqs))
    cut = [0] * len(seqs)
    while True:
        grown = False
        for i, s in enumerate(seqs):
            if cut[i] < len(s):
                cut[i] = min(len(s), cut[i] + rng.randrange(1, 6))
                grown = True
        out = p.propose([DraftRequest(i, list(s[: cut[i]]), k) for i, s in enumerate(seqs)])
        if not grown:
            return out.tokens, out.num_tokens


LOOKUPS = {
    "vectorised": lambda seqs, k, lo, hi: ngram_lookup(seqs, k, lo, hi),
    "incremental": _incremental,
}


@pytest.mark.parametrize("impl", LOOKUPS)
def test_examples(impl: str):
    lookup = LOOKUPS[impl]
    drafts, num = lookup([[1, 2, 3, 4, 1, 2], [5, 6, 7], [9], [], [1, 2, 1, 2, 1, 2]], 3, 1, 3)
    assert num.tolist() == [3, 0, 0, 0, 3]
    assert drafts[0].tolist() == [3, 4, 1]
    # the longest (3) match, the most recent one, continued with its period (2)
    assert drafts[4].tolist() == [1, 2, 1]
    drafts, num = lookup([[7, 1, 8, 1, 2, 9, 3, 1, 2]], 2, 2, 4)
    assert num.tolist() == [2] and drafts[0].tolist() == [9, 3]
    drafts, num = lookup([[7, 1, 8, 3, 2]], 2, 2, 4)  # only 1-token matches: under min_n
    assert num.tolist() == [0]


@pytest.mark.parametrize("impl", LOOKUPS)
@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 1), (1, 4, 3), (2, 5, 5), (3, 3, 2)])
def test_matches_reference_on_random_repetitive_sequences(
    impl: str, min_n: int, max_n: int, k: int
):
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    seqs = []
    for _ in range(200):
        vocab = rng.choice([3, 5, 20])
        seqs.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 40))])
    drafts, num = LOOKUPS[impl](seqs, k, min_n, max_n)
    for i, s in enumerate(seqs):
        ref = _reference(s, k, min_n, max_n)
        assert drafts[i, : num[i]].tolist() == ref, (s, ref)
        assert bool((drafts[i, num[i] :] == -1).all())


def test_vectorised_lookup_for_256_long_sequences():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 32000, size=int(rng.integers(500, 2048))) for _ in range(256)]
    ngram_lookup(seqs, 4, 1, 4)
    t0 = time.perf_counter()
    for _ in range(3):
        ngram_lookup(seqs, 4, 1, 4)
    per_call = (time.perf_counter() - t0) / 3
    # a loose bound for a shared CI core; well under a ms per sequence
    assert per_call < 0.5, per_call


def test_incremental_proposer_steady_state_for_256_sequences():
    """The engine's per-step cost: 256 sequences of 500-2048 tokens (prompts indexed on the
    first call), each grown by 1-5 accepted tokens before every later call."""
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 200, size=int(rng.integers(500, 2048))).tolist() for _ in range(256)]
    p = NgramProposer(k=4, min_n=2, max_n=4)
    t0 = time.perf_counter()
    p.propose([DraftRequest(i, s, 4) for i, s in enumerate(seqs)])
    first = time.perf_counter() - t0
    steps = 20
    growth = [[rng.integers(0, 200, size=int(rng.integers(1, 6))).tolist() for _ in seqs]
              for _ in range(steps)]  # fmt: skip
    spent = 0.0
    for grown in growth:  # only the requests and the proposals are timed
        for s, new in zip(seqs, grown, strict=True):
            s.extend(new)
        t0 = time.perf_counter()
        out = p.propose([DraftRequest(i, s, 4) for i, s in enumerate(seqs)])
        spent += time.perf_counter() - t0
    per_step = spent / steps
    print(f"n-gram proposals, 256 sequences: first call {first * 1e3:.1f} ms (prompts "
          f"indexed), then {per_step * 1e3:.2f} ms per step")  # fmt: skip
    assert out.num_tokens.sum() > 0  # a 200-token vocabulary recurs: some drafts
    # generous for a shared CI core (a few ms here; a decode step is ~10-20 ms on a GPU)
    assert per_step < 0.05, per_step
    p.release(range(256))
    assert not p._ends and not p._seqs


def test_a_reused_seq_id_with_other_tokens_starts_over_and_release_forgets_it():
    """A seq_id whose tokens are no longer a continuation (shorter than what was indexed)
    is indexed afresh: its old n-grams neither match nor stay behind."""
    p = NgramProposer(k=2, min_n=2, max_n=3)
    first = [5, 6, 7, 5, 6, 7, 5, 6, 8, 9, 1, 2, 3]
    p.propose([DraftRequest(1, first, 2)])
    entries = len(p._ends)
    assert entries > 0
    other = [1, 2, 3, 1, 2]  # shorter: not the same sequence
    out = p.propose([DraftRequest(1, other, 2)])
    assert out.tokens[0, : out.num_tokens[0]].tolist() == _reference(other, 2, 2, 3) == [3, 1]
    # only the new sequence's n-grams: ends 1..3 of sizes 2 and 3
    assert len(p._ends) == 3 + 2
    p.release([1])
    assert not p._ends and not p._seqs
