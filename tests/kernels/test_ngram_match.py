"""The device n-gram lookup (``kernels.ngram_match``) and its proposer against the host
reference (``ngram_lookup``) and the host proposer (``NgramProposer``)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvscale.kernels.ngram_match import BLOCK, ngram_match, pack_inputs
from kvscale.server.spec_decode.ngram_device import DeviceNgramProposer
from kvscale.server.spec_decode.ngram_proposer import NgramProposer, ngram_lookup
from kvscale.server.spec_decode.proposer import DraftRequest


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 1), (1, 4, 4), (2, 5, 8), (3, 3, 2)])
def test_kernel_matches_the_reference(device: torch.device, min_n: int, max_n: int, k: int):
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    seqs = []
    for _ in range(48):
        vocab = rng.choice([3, 5, 20, 1000])
        n = rng.choice([0, 1, 2, rng.randrange(3, 40), rng.randrange(BLOCK - 5, 2 * BLOCK + 9)])
        seqs.append([rng.randrange(vocab) for _ in range(n)])
    # each sequence in a shuffled row of a wider buffer, garbage past its end
    width = max(map(len, seqs)) + 7
    rows = rng.sample(range(len(seqs) + 5), len(seqs))
    hist = torch.randint(0, 3, (len(seqs) + 5, width), dtype=torch.int32)
    for row, s in zip(rows, seqs, strict=True):
        hist[row, : len(s)] = torch.tensor(s, dtype=torch.int32)
    lengths = np.array([len(s) for s in seqs])
    packed = torch.from_numpy(pack_inputs(np.array(rows), lengths)).to(device)
    out = ngram_match(hist.to(device), packed, len(seqs), k, min_n, max_n)
    want, want_num = ngram_lookup(seqs, k, min_n, max_n)
    assert out[:, k].cpu().tolist() == want_num.tolist()
    assert out[:, :k].cpu().tolist() == want.tolist()


def test_device_proposer_drafts_as_the_host_proposer(device: torch.device):
    """Incremental steps over a changing batch: sequences grow by 1-5 tokens, some leave
    (released) and new ones come, a released id comes back with other tokens, k varies
    per request (not only powers of two); the rows are regrown past their first width."""
    rng = random.Random(7)
    host = NgramProposer(k=5, min_n=1, max_n=3)
    dev = DeviceNgramProposer(5, 1, 3, device)
    seqs: dict[int, list[int]] = {}
    next_id = 0
    for step in range(40):
        while len(seqs) < 6:
            seqs[next_id] = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
            next_id += 1
        if step % 7 == 3:
            gone = rng.choice(sorted(seqs))
            del seqs[gone]
            host.release([gone])
            dev.release([gone])
            if step == 10:  # the same id again, a new sequence
                seqs[gone] = [rng.randrange(6) for _ in range(5)]
        for s in seqs.values():
            s += [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
            if step == 20:
                s += [rng.randrange(6) for _ in range(1100)]  # past MIN_WIDTH
        reqs = [DraftRequest(i, s, rng.choice([1, 3, 5, 7])) for i, s in sorted(seqs.items())]
        a, b = host.propose(reqs), dev.propose(reqs)
        assert a.num_tokens.tolist() == b.num_tokens.tolist(), step
        assert a.tokens.tolist() == b.tokens.tolist(), step
        assert b.num_tokens.max() > 0
    dev.release(list(seqs))
    assert not dev._slot and len(dev._free) == dev._hist.shape[0]
    assert np.all(dev._upto == 0)
