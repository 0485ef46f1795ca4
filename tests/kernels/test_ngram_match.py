"""The device n-gram lookup (``kernels.ngram_match``) and its proposer against the host
reference (``ngram_lookup``) and the host proposer (``NgramProposer``)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from kvscale.kernels.ngram_match import BLOCK, ngram_after_verify, ngram_match, pack_inputs
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


@pytest.mark.parametrize("k", [1, 4])
def test_after_verify_appends_the_emitted_tokens_and_drafts(device: torch.device, k: int):
    """The verify follow-up: each row's emitted tokens (``num_accepted + 1`` of the
    sampler's ``[N, T]`` output, the rest padding) appended after the row's tokens, then
    the lookup over the longer sequence; the new length in the last column."""
    rng = random.Random(k)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 300))] for _ in range(21)]
    t = 5
    emitted = torch.full((len(seqs), t), -7, dtype=torch.int64)
    accepted = torch.tensor([rng.randrange(t) for _ in seqs], dtype=torch.int64)
    for i, a in enumerate(accepted.tolist()):
        emitted[i, : a + 1] = torch.tensor([rng.randrange(4) for _ in range(a + 1)])
    rows = rng.sample(range(len(seqs) + 4), len(seqs))
    hist = torch.randint(0, 4, (len(seqs) + 4, 320), dtype=torch.int32)  # garbage past ends
    for row, s in zip(rows, seqs, strict=True):
        hist[row, : len(s)] = torch.tensor(s, dtype=torch.int32)
    n2 = len(seqs) + (len(seqs) & 1)
    staged = torch.zeros(2 * n2, dtype=torch.int64)
    staged[: len(seqs)] = torch.tensor(rows)
    staged[n2 : n2 + len(seqs)] = torch.tensor([len(s) for s in seqs])
    hist_d = hist.to(device)
    out = torch.zeros(len(seqs) * (k + 2), dtype=torch.int32, device=device)
    ngram_after_verify(
        hist_d, staged.to(device), emitted.to(device), accepted.to(device), k, 1, 3, out
    )
    full = [
        s + emitted[i, : a + 1].tolist()
        for i, (s, a) in enumerate(zip(seqs, accepted.tolist(), strict=True))
    ]
    want, want_num = ngram_lookup(full, k, 1, 3)
    got = out.cpu().view(len(seqs), k + 2)
    assert got[:, :k].tolist() == want.tolist()
    assert got[:, k].tolist() == want_num.tolist()
    assert got[:, k + 1].tolist() == [len(s) for s in full]
    for row, s in zip(rows, full, strict=True):
        assert hist_d[row, : len(s)].cpu().tolist() == s


def test_device_proposer_follows_verify_steps(device: torch.device):
    """Verify steps over a changing batch, as the engine drives them: ``stage_verify``
    with the rows that verify, ``after_verify`` with the sampler's output, the emitted
    tokens appended; then ``propose`` (with the host's tokens, some grown by a normal step
    in between, some new) equals the host proposer's, and most come from the follow-up."""
    rng = random.Random(3)
    host = NgramProposer(k=4, min_n=1, max_n=3)
    dev = DeviceNgramProposer(4, 1, 3, device)
    seqs: dict[int, list[int]] = {i: [rng.randrange(5) for _ in range(20)] for i in range(6)}
    next_id = 6
    for step in range(30):
        reqs = [DraftRequest(i, s, 4) for i, s in sorted(seqs.items())]
        a, b = host.propose(reqs), dev.propose(reqs)
        assert a.num_tokens.tolist() == b.num_tokens.tolist(), step
        assert a.tokens.tolist() == b.tokens.tolist(), step
        verifying = [r.seq_id for r, d in zip(reqs, b.num_tokens.tolist(), strict=True) if d]
        rng.shuffle(verifying)  # row order is the step's, not the proposer's
        n = len(verifying)
        tokens = torch.full((n, 5), -1, dtype=torch.int64)
        accepted = torch.tensor([rng.randrange(5) for _ in range(n)], dtype=torch.int64)
        for i, acc in enumerate(accepted.tolist()):
            tokens[i, : acc + 1] = torch.tensor([rng.randrange(5) for _ in range(acc + 1)])
        dev.stage_verify(verifying)
        dev.after_verify(tokens.to(device), accepted.to(device))
        for i, sid in enumerate(verifying):
            seqs[sid] += tokens[i, : int(accepted[i]) + 1].tolist()
        if step % 5 == 2:  # a normal step: every sequence one token longer
            for s in seqs.values():
                s.append(rng.randrange(5))
        if step % 6 == 4:  # one finishes, one comes
            gone = rng.choice(sorted(seqs))
            del seqs[gone]
            host.release([gone])
            dev.release([gone])
            seqs[next_id] = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
            next_id += 1
    assert dev.ready_hits > 50


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="a CPU engine; on a GPU tests/gpu/test_spec_cuda.py runs the engine on CUDA",
)
@pytest.mark.parametrize("model", ["random", "echo"])
def test_engine_drafts_from_the_verify_follow_up(
    model: str, llama_ckpt, echo_ckpt, monkeypatch: pytest.MonkeyPatch
):
    """The engine with the device proposer (as on a GPU): greedy with n-gram drafts is
    token-identical to greedy without, under chunked prefill and preemption; on the echo
    model the drafts after a verify step come from its follow-up on the device."""
    from kvscale.server import LLM, SamplingParams
    from kvscale.server.engine import engine_core
    from tests.hf_reference import random_prompts

    path = str(llama_ckpt if model == "random" else echo_ckpt)
    prompts = [p + p[: len(p) // 2] for p in random_prompts(8, (2, 50), seed=5)]
    tight = dict(
        device="cpu", num_kv_blocks=36, max_model_len=160, block_size=8,
        max_num_batched_tokens=32, max_num_seqs=8,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = LLM(path, **tight).generate(prompts, greedy)
    made: list[DeviceNgramProposer] = []

    def device_proposer(config):
        eng = config.engine
        made.append(DeviceNgramProposer(eng.num_speculative_tokens, 1, 3, config.torch_device))
        return made[-1]

    monkeypatch.setattr(engine_core, "make_proposer", device_proposer)
    llm = LLM(path, **tight, speculative_method="ngram", num_speculative_tokens=4)
    spec = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    if model == "echo":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 50
        assert made[0].ready_hits > 0.5 * stats.spec_num_drafts
