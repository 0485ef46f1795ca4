"""``l2_prefetch``'s load mode reads exactly the bytes asked for (rounded down to whole
2 KiB blocks), each once: its programs' sums add up to those bytes' int32 words. On a
GPU the PTX modes run too (they leave no trace to check but must not fault)."""

from __future__ import annotations

import pytest
import torch

from kvscale.kernels.l2_prefetch import l2_prefetch


@pytest.mark.parametrize("nbytes", [None, 2048, 5000, 2047])
@pytest.mark.parametrize("programs", [1, 3])
def test_load_mode_reads_the_blocks_asked_for(device: str, nbytes: int | None,
                                              programs: int) -> None:
    t = torch.randint(-1000, 1000, (3, 4096), dtype=torch.int32, device=device)
    sink = torch.zeros(8, dtype=torch.int32, device=device)
    l2_prefetch(t, sink, nbytes, "load", programs)
    size = t.numel() * 4 if nbytes is None else nbytes
    words = size // 2048 * 512
    assert int(sink.sum()) == int(t.view(-1)[:words].sum())
    assert not sink[programs:].any()  # one word a program, no more


def test_bad_requests_are_refused(device: str) -> None:
    t = torch.zeros(4096, dtype=torch.int32, device=device)
    sink = torch.zeros(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="mode 'nope'"):
        l2_prefetch(t, sink, None, "nope")
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(t.view(64, 64).t(), sink)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PTX prefetches need a GPU")
@pytest.mark.parametrize("mode", ["prefetch", "bulk"])
def test_ptx_modes_run_and_change_nothing(mode: str) -> None:
    if mode == "bulk" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("bulk prefetch needs compute capability 9.0")
    t = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    before = t.clone()
    sink = torch.zeros(132, dtype=torch.int32, device="cuda")
    l2_prefetch(t, sink, None, mode, 132)
    l2_prefetch(t, sink, 3 << 20, mode, 16)
    torch.cuda.synchronize()
    assert torch.equal(t, before)
