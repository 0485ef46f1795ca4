"""The next GEMM's weights fetched into L2 while a small decode step waits on latency.

A decode step of a few rows alternates between GEMMs, which stream their weights from
memory, and kernels bound by latency (the all-reduce and the norm after it, RoPE and
attention), during which memory idles. At the start of such a stretch the model names
the layer it multiplies next (``prefetch``); inside ``prefetching(p)`` that forks
``p``'s side stream off the current one and fetches the layer's weights into L2 there
(``kvscale.kernels.l2_prefetch``), so the GEMM reads them from L2. The GEMM does not
wait for the fetch: lines still in flight are read from memory as before. The streams
join when the block ends (a CUDA graph's capture must join what it forked).

Only the decode CUDA graphs of up to ``MAX_ROWS`` rows run inside ``prefetching`` (NOTES
e54: measured at one row); elsewhere ``prefetch`` does nothing. ``KVSCALE_L2_PREFETCH=0``
turns it off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

MAX_ROWS = 8
# of gate_up's weights, what an all-reduce's wait has room for (bench/l2_prefetch.py,
# TP=2 shapes on an H100: 16 and 32 MB gained alike, 0 less)
ALL_REDUCE_BYTES = 16 * 2**20
PROGRAMS = 132


def supported(device: torch.device) -> bool:
    """The GPU can take the fetch (compute capability 8.0+) and it is not turned off."""
    if os.environ.get("KVSCALE_L2_PREFETCH", "1") == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


class WeightPrefetcher:
    """A side stream and the scratch its fetches write (one a worker)."""

    def __init__(self, device: torch.device) -> None:
        major, _ = torch.cuda.get_device_capability(device)
        # Hopper's bulk prefetch asks for 4 KiB an instruction; before it, one line
        self.mode = "bulk" if major >= 9 else "prefetch"
        self.stream = torch.cuda.Stream(device)
        self.sink = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)
        self.forked = False

    def fetch(self, layer: nn.Module, nbytes: int | None) -> None:
        """Fetches the first ``nbytes`` (None: all) of the weights ``layer``'s linear
        method reads at a few rows, on the side stream, after the current stream's work."""
        from kvscale.kernels.l2_prefetch import l2_prefetch

        tensors = layer.linear_method.small_batch_weights(layer)  # type: ignore[union-attr]
        left = nbytes
        if not tensors or left == 0:
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        self.forked = True
        with torch.cuda.stream(self.stream):
            for t in tensors:
                size = t.numel() * t.element_size()
                l2_prefetch(t, self.sink, left, self.mode, PROGRAMS)
                if left is not None:
                    left -= min(left, size)
                    if left == 0:
                        break

    def join(self) -> None:
        """The current stream waits for every fetch forked so far."""
        if self.forked:
            torch.cuda.current_stream().wait_stream(self.stream)
            self.forked = False


_current: WeightPrefetcher | None = None


@contextlib.contextmanager
def prefetching(prefetcher: WeightPrefetcher | None) -> Iterator[None]:
    """``prefetch`` fetches through ``prefetcher`` (None: does nothing) inside the block;
    the side stream is joined at its end."""
    global _current
    previous, _current = _current, prefetcher
    try:
        yield
    finally:
        _current = previous
        if prefetcher is not None:
            prefetcher.join()


def prefetch(layer: nn.Module, nbytes: int | None = None) -> None:
    """Starts fetching ``layer``'s weights (the first ``nbytes``; None: all) into L2 if a
    step runs inside ``prefetching``; else nothing."""
    if _current is not None:
        _current.fetch(layer, nbytes)
