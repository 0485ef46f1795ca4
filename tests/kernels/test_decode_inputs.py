"""A decode step's inputs copied into the decode graphs' static buffers in one launch,
placeholders resolved, against what it replaces: ``resolve_placeholders`` and the copies."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.decode_inputs import load_decode_inputs
from kvscale.server.worker.step import resolve_placeholders

MAX_ROWS, MAX_COLS = 16, 1100  # past 1,024 columns the kernel copies a row in chunks


def _static(device: torch.device) -> tuple[torch.Tensor, ...]:
    """Static buffers filled with markers, to see what the copy leaves alone."""
    return (
        torch.full((MAX_ROWS,), -5, dtype=torch.long, device=device),
        torch.full((MAX_ROWS,), -6, dtype=torch.long, device=device),
        torch.full((MAX_ROWS,), -7, dtype=torch.long, device=device),
        torch.full((MAX_ROWS,), -8, dtype=torch.int32, device=device),
        torch.full((MAX_ROWS, MAX_COLS), -9, dtype=torch.int32, device=device),
    )


def _step(bs: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, 32_000, (bs,))
    ids[::2] = -(torch.randperm(bs)[: (bs + 1) // 2] + 1)  # placeholders: rows of last
    return (
        ids.to(device),
        torch.randint(0, 4096, (bs,), device=device),
        torch.randint(-1, 9999, (bs,), device=device),
        torch.randint(1, 4096, (bs,), dtype=torch.int32, device=device),
        torch.randint(0, 500, (bs, width), dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize(("bs", "width"), [(1, 1), (3, 7), (16, 40), (5, 33), (2, 1030)])
def test_one_launch_equals_the_copies_and_the_placeholders(
    bs: int, width: int, device: torch.device
) -> None:
    ids, positions, slots, seq_lens, tables = _step(bs, width, device)
    last = torch.randint(0, 32_000, (MAX_ROWS,), device=device)
    got = _static(device)
    load_decode_inputs(ids, positions, slots, seq_lens, tables, last, got)
    want = _static(device)
    want[0][:bs] = resolve_placeholders(ids, last)
    for buf, src in zip(want[1:4], (positions, slots, seq_lens), strict=True):
        buf[:bs] = src
    want[4][:bs, :width] = tables
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)  # rows past bs and columns past width untouched too
    assert (got[0][:bs] >= 0).all()


def test_a_table_with_padded_rows(device: torch.device) -> None:
    """The step's table as a view with a row stride wider than its columns."""
    ids, positions, slots, seq_lens, tables = _step(4, 9, device)
    wide = torch.zeros(4, 20, dtype=torch.int32, device=device)
    wide[:, :9] = tables
    last = torch.arange(MAX_ROWS, device=device)
    got = _static(device)
    load_decode_inputs(ids, positions, slots, seq_lens, wide[:, :9], last, got)
    assert torch.equal(got[4][:4, :9], tables)
    assert (got[4][:4, 9:] == -9).all()


def test_inputs_that_do_not_fit_are_refused(device: torch.device) -> None:
    ids, positions, slots, seq_lens, tables = _step(4, 9, device)
    last = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=r"must be \[4\]"):
        load_decode_inputs(ids[:3], positions, slots, seq_lens, tables, last, _static(device))
    wide = torch.zeros(4, MAX_COLS + 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="static buffers hold 16 rows x 1100"):
        load_decode_inputs(ids, positions, slots, seq_lens, wide, last, _static(device))
