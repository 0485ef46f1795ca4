"""The n-gram (prompt lookup) proposer against a plain Python reference, and its speed."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from kvscale.server.spec_decode.ngram_proposer import NgramProposer


def _reference(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    n_len = len(seq)
    for n in range(min(max_n, n_len - 1), min_n - 1, -1):
        suffix = seq[n_len - n :]
        for end in range(n_len - 2, n - 2, -1):  # most recent first
            if seq[end - n + 1 : end + 1] == suffix:
                return seq[end + 1 : end + 1 + k]
    return []


def test_examples():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    drafts, num = p.propose([[1, 2, 3, 4, 1, 2], [5, 6, 7], [9], [], [1, 2, 1, 2, 1, 2]])
    assert num.tolist() == [3, 0, 0, 0, 2]
    assert drafts[0].tolist() == [3, 4, 1]
    assert drafts[4].tolist() == [1, 2, -1]  # longest (3) match, the most recent one
    p2 = NgramProposer(k=2, min_n=2, max_n=4)
    drafts, num = p2.propose([[7, 1, 8, 1, 2, 9, 3, 1, 2]])
    assert num.tolist() == [2] and drafts[0].tolist() == [9, 3]
    drafts, num = p2.propose([[7, 1, 8, 3, 2]])  # only 1-token matches: under min_n
    assert num.tolist() == [0]


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 1), (1, 4, 3), (2, 5, 5), (3, 3, 2)])
def test_matches_reference_on_random_repetitive_sequences(min_n: int, max_n: int, k: int):
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    seqs = []
    for _ in range(200):
        vocab = rng.choice([3, 5, 20])
        seqs.append([rng.randrange(vocab) for _ in range(rng.randrange(0, 40))])
    drafts, num = NgramProposer(k, min_n, max_n).propose(seqs)
    for i, s in enumerate(seqs):
        ref = _reference(s, k, min_n, max_n)
        assert drafts[i, : num[i]].tolist() == ref, (s, ref)
        assert bool((drafts[i, num[i] :] == -1).all())


def test_fast_for_256_sequences():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 32000, size=int(rng.integers(500, 2048))) for _ in range(256)]
    p = NgramProposer(k=4, min_n=1, max_n=4)
    p.propose(seqs)
    t0 = time.perf_counter()
    for _ in range(3):
        p.propose(seqs)
    per_call = (time.perf_counter() - t0) / 3
    # a loose bound for a shared CI core; well under a ms per sequence
    assert per_call < 0.5, per_call
