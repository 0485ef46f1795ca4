"""The nucleus threshold by radix select against the sort-based reference: the same kept
set on sharp and flat distributions, ties, zeros (top-k's masked tokens), top_p 0 and 1."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.top_p import MIN_ROWS, top_p_threshold, top_p_threshold_ref


def _probs(rows: int, vocab: int, scale: float, device: torch.device) -> torch.Tensor:
    return torch.softmax(scale * torch.randn(rows, vocab, device=device), dim=-1)


def _sorted_kept(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens the old sampler kept: sorted, while the mass before them is below top_p; all
    of them at top_p 1 (the old sampler's fp32 cumulative sum reached 1.0 early and lost
    the tail of sharp rows there: 942 tokens of 1,000 in one row of this test)."""
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    keep_sorted = (torch.cumsum(ordered, -1) - ordered) < top_p.unsqueeze(1)
    keep_sorted[:, 0] = True
    keep_sorted[top_p >= 1.0] = True
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _assert_nucleus(probs: torch.Tensor, top_p: torch.Tensor, tau: torch.Tensor) -> None:
    """``tau`` is a value of its row whose mass at or above reaches top_p and whose mass
    strictly above does not (in fp64, to fp32's rounding of the sums); where no sorted
    token's mass before it lies within that rounding of top_p, the kept set is the
    sort's exactly."""
    tol = 1e-5
    p64 = probs.double()
    for row, (p, t) in enumerate(zip(top_p.tolist(), tau.tolist(), strict=True)):
        if p >= 1.0:
            assert t == 0.0
            continue
        assert t in probs[row].tolist()
        assert p64[row][p64[row] >= t].sum().item() >= p - tol
        assert p64[row][p64[row] > t].sum().item() < max(p, 0.0) + tol
    ordered = torch.sort(p64, dim=-1, descending=True).values
    before = torch.cumsum(ordered, -1) - ordered
    clear = ((before - top_p.double().unsqueeze(1)).abs() > 1e-5).all(dim=-1)
    kept = probs >= tau.unsqueeze(1)
    assert torch.equal(kept[clear], _sorted_kept(probs, top_p)[clear])


@pytest.mark.parametrize("vocab", [1, 7, 1000, 3000])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_threshold_keeps_the_nucleus(vocab: int, scale: float, device: torch.device) -> None:
    top_p = torch.tensor([0.0, 1e-6, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0], device=device)
    probs = _probs(len(top_p), vocab, scale, device)
    got = top_p_threshold(probs, top_p, min_rows=0)
    _assert_nucleus(probs, top_p, got)
    _assert_nucleus(probs, top_p, top_p_threshold_ref(probs, top_p))
    assert got[-1].item() == 0.0  # top_p 1: every token
    assert got[0].item() == probs[0].max().item()  # top_p 0: the most likely token


@pytest.mark.parametrize("digit_bits", [2, 4, 5])
def test_every_digit_width(digit_bits: int, device: torch.device) -> None:
    top_p = torch.tensor([0.0, 0.5, 0.9, 0.999, 1.0], device=device)
    probs = _probs(len(top_p), 1000, 3.0, device)
    got = top_p_threshold(probs, top_p, digit_bits, min_rows=0)
    _assert_nucleus(probs, top_p, got)


@pytest.mark.parametrize("chunk", [1024, 2048])
@pytest.mark.parametrize("scale", [0.3, 12.0])
def test_several_chunks_a_row(chunk: int, scale: float, device: torch.device) -> None:
    top_p = torch.tensor([0.0, 0.5, 0.9, 0.999, 1.0, 0.7, 0.3, 0.95], device=device)
    probs = _probs(len(top_p), 3000, scale, device)  # 3 or 2 chunks, the last partial
    got = top_p_threshold(probs, top_p, min_rows=0, chunk=chunk)
    _assert_nucleus(probs, top_p, got)


def test_ties_and_zeros(device: torch.device) -> None:
    quarter = torch.tensor([0.25, 0.0, 0.25, 0.25, 0.0, 0.25], device=device)
    skewed = torch.tensor([0.1, 0.4, 0.0, 0.2, 0.2, 0.1], device=device)
    probs = torch.stack([quarter, quarter, skewed, skewed, skewed])
    top_p = torch.tensor([0.5, 0.8, 0.4, 0.5, 0.75], device=device)
    got = top_p_threshold(probs, top_p, min_rows=0)
    assert got.tolist() == top_p_threshold_ref(probs, top_p).tolist()
    kept = (probs >= got.unsqueeze(1)).int().tolist()
    assert kept[0] == [1, 0, 1, 1, 0, 1]  # tied with the last member: every quarter
    assert kept[2] == [0, 1, 0, 0, 0, 0]  # 0.4 reaches 0.4
    assert kept[3] == [0, 1, 0, 1, 1, 0]  # 0.4 + 0.2, and 0.2's tie
    assert kept[4] == [0, 1, 0, 1, 1, 0]  # 0.8 reaches 0.75


def test_masked_rows_and_a_llama3_vocabulary(device: torch.device) -> None:
    probs = _probs(2, 128256, 4.0, device)
    top = probs[1].topk(50)
    probs[1] = 0.0
    probs[1, top.indices] = top.values / top.values.sum()  # top-k's survivors only
    top_p = torch.tensor([0.9, 0.6], device=device)
    got = top_p_threshold(probs, top_p, min_rows=0)
    _assert_nucleus(probs, top_p, got)


def test_fewer_rows_than_min_rows_sort(device: torch.device) -> None:
    probs = _probs(MIN_ROWS - 1, 1000, 3.0, device)
    top_p = torch.full((MIN_ROWS - 1,), 0.9, device=device)
    want = top_p_threshold_ref(probs, top_p)
    assert torch.equal(top_p_threshold(probs, top_p), want)
    _assert_nucleus(probs, top_p, top_p_threshold(probs, top_p, min_rows=0))


def test_strided_rows_and_errors(device: torch.device) -> None:
    wide = _probs(4, 1200, 2.0, device)
    probs = wide[:, :1000] / wide[:, :1000].sum(-1, keepdim=True)
    probs = torch.empty(4, 1200, device=device)[:, :1000].copy_(probs)  # row stride 1200
    top_p = torch.full((4,), 0.8, device=device)
    _assert_nucleus(probs, top_p, top_p_threshold(probs, top_p, min_rows=0))
    assert top_p_threshold(probs[:0], top_p[:0], min_rows=0).shape == (0,)
    with pytest.raises(ValueError, match=r"probs must be \[N, V\] fp32"):
        top_p_threshold(probs.half(), top_p)
    with pytest.raises(ValueError, match=r"top_p must be \[4\] fp32"):
        top_p_threshold(probs, top_p[:2])
    with pytest.raises(ValueError, match=r"digit_bits must be one of \(2, 3, 4, 5\), got 6"):
        top_p_threshold(probs, top_p, 6)
    with pytest.raises(ValueError, match="chunk must be a power of two >= 1024, got 3000"):
        top_p_threshold(probs, top_p, chunk=3000)
