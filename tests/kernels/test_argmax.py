"""The two-pass argmax against ``torch.argmax``: the same index, ties (the first wins) and
NaN (larger than anything) included."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.argmax import argmax, argmax_ref
from kvscale.kernels.testing import kernel_dtypes


@pytest.mark.parametrize("dtype", kernel_dtypes(), ids=str)
@pytest.mark.parametrize("vocab", [1, 7, 256, 1000, 3000])
@pytest.mark.parametrize("chunk", [None, 256])
def test_argmax_matches_torch(
    dtype: torch.dtype, vocab: int, chunk: int | None, device: torch.device
) -> None:
    x = torch.randn(5, vocab, device=device).to(dtype)
    if vocab >= 1000:
        top = x.max().item() + 1
        x[1, [900, 17, 600]] = top  # ties (across chunks of 256): the first wins
        x[2, [40, 41]] = top  # ties within a chunk
        x[3] = float("-inf")  # all -inf: index 0
        x[4, [700, 300]] = float("inf")
        x[4, [950, 800]] = float("nan")  # NaN beats inf: the first NaN
    got = argmax(x, chunk)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist() == argmax_ref(x).tolist()
    if vocab >= 1000:
        assert got[1:].tolist() == [17, 40, 0, 800]


def test_a_llama3_vocabulary(device: torch.device) -> None:
    x = torch.randn(2, 128256, device=device)
    x[1, 128255] = 100.0  # the last element, in the last (partial) chunk
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist()


def test_strided_rows_and_errors(device: torch.device) -> None:
    x = torch.randn(3, 1200, device=device)[:, :1000]  # row stride 1200
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert argmax(x[:0]).shape == (0,)
    with pytest.raises(ValueError, match=r"x must be \[N, V\]"):
        argmax(torch.zeros(4, device=device))
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        argmax(x, chunk=100)
