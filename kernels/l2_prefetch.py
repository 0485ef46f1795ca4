"""Reads a tensor's bytes into the GPU's L2 cache ahead of the kernel that needs them.

At batch 1 a decode step alternates between kernels bound by memory (the GEMMs stream
their weights) and kernels bound by latency (the all-reduce, attention, the norms), during
which memory idles. Launched on a second stream at the start of such a stretch, this
kernel fetches the next GEMM's weights (or their first bytes) into L2, so the GEMM reads
them from L2 (PRESERVE, arXiv 2501.08192, does this around all-reduces).

Modes (how the lines are asked for):

- ``load``: 16-byte loads that ask L2 to keep the lines (``evict_last``); the loaded
  words are summed into one word a program so that the loads stay (any GPU, and the
  Triton interpreter);
- ``prefetch``: PTX ``prefetch.global.L2::evict_last``, one a 128-byte line (no registers
  wait for the data; NVIDIA GPUs);
- ``bulk``: PTX ``cp.async.bulk.prefetch.L2.global``, one instruction a chunk of
  ``BULK_BYTES`` (Hopper, compute capability 9.0+).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODES = ("load", "prefetch", "bulk")
LINE_BYTES = 128
BULK_BYTES = 4096
PROGRAMS = 64  # default grid: enough loads in flight, few of the SMs


@triton.jit
def _l2_load_kernel(src, sink, n_blocks, BLOCK: tl.constexpr):
    """``src``: int32 words; program p reads blocks p, p + grid, ... of ``BLOCK`` words
    (16 bytes a thread a load) and writes their sum to ``sink[p]``."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(pid, n_blocks, tl.num_programs(0)):
        acc += tl.load(src + b * BLOCK + tl.arange(0, BLOCK),
                       eviction_policy="evict_last")
    tl.store(sink + pid, tl.sum(acc, axis=0))


@triton.jit
def _l2_prefetch_kernel(src, sink, n_blocks, UNIT_WORDS: tl.constexpr, BLOCK: tl.constexpr,
                        BULK: tl.constexpr, BULK_BYTES: tl.constexpr):
    """``src``: int32 words; program p asks L2 for blocks p, p + grid, ... of ``BLOCK``
    units (lines, or bulk chunks) of ``UNIT_WORDS`` words, one unit a thread, through PTX."""
    pid = tl.program_id(0)
    done = tl.zeros([BLOCK], dtype=tl.int32)
    for b in range(pid, n_blocks, tl.num_programs(0)):
        ptrs = src + (b * BLOCK + tl.arange(0, BLOCK)) * UNIT_WORDS
        if BULK:
            done += tl.inline_asm_elementwise(
                f"cp.async.bulk.prefetch.L2.global [$1], {BULK_BYTES}; mov.u32 $0, 0;",
                "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        else:
            done += tl.inline_asm_elementwise(
                "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
                "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink + pid, tl.sum(done, axis=0))


def l2_prefetch(
    t: torch.Tensor,
    sink: torch.Tensor,
    nbytes: int | None = None,
    mode: str = "prefetch",
    programs: int = PROGRAMS,
) -> None:
    """Fetches the first ``nbytes`` (default: all) of contiguous ``t`` into L2 on the
    current stream, rounded down to whole blocks (``load``: 2 KiB, ``prefetch``: 16 KiB,
    ``bulk``: 512 KiB). ``sink``: int32 scratch of at least ``programs`` elements (its
    values mean nothing)."""
    if mode not in MODES:
        raise ValueError(f"l2_prefetch mode {mode!r}: expected one of {MODES}")
    if not t.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous tensor")
    size = t.numel() * t.element_size()
    nbytes = size if nbytes is None else min(nbytes, size)
    unit = {"load": 16, "prefetch": LINE_BYTES, "bulk": BULK_BYTES}[mode]
    block = 128  # units a program asks for at once: one a thread of 4 warps
    n_blocks = nbytes // (unit * block)
    if n_blocks == 0:
        return
    if nbytes >= 2**33:  # word offsets are int32 in the kernels
        raise ValueError(f"l2_prefetch fetches under 8 GiB at a time, not {nbytes} bytes")
    words = t.view(-1).view(torch.uint8)[: n_blocks * unit * block].view(torch.int32)
    grid = (max(1, min(programs, sink.numel(), n_blocks)),)
    if mode == "load":
        _l2_load_kernel[grid](words, sink, n_blocks, BLOCK=block * 4)
    else:
        _l2_prefetch_kernel[grid](words, sink, n_blocks, UNIT_WORDS=unit // 4, BLOCK=block,
                                  BULK=mode == "bulk", BULK_BYTES=BULK_BYTES)
