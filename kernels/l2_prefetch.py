"""Prefetching a tensor's bytes from GPU memory into the L2 cache (Hopper and later).

At small batches a decode step alternates weight-bound GEMMs, which stream their weights
at close to the memory's bandwidth, with latency-bound kernels (rotary, attention, the
split-KV reduction, norms) that leave the memory mostly idle. A prefetch issued before
such a stretch, on a side stream, moves the next GEMM's weights into L2 meanwhile, so
the GEMM reads them from L2 instead of from memory (an H100 holds 50 MB of L2: one
8B-model o_proj, 33.5 MB in bf16, fits).

The kernel issues ``cp.async.bulk.prefetch.L2.global`` (sm_90+): each thread asks the
memory system for one contiguous chunk; nothing comes back to the SM and nothing waits,
so the kernel is a few instructions a thread. It is a hint: the data need not arrive,
and nothing reads its result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import is_interpreter, num_sms

ALIGN = 16  # the instruction's address and size granularity (bytes)
MIN_CHUNK = 4096  # bytes a thread asks for at least
MAX_CHUNK = 1 << 19  # at most (sm_90's instruction takes the size in 16-bit units of 16 bytes)
THREADS = 32  # one warp a program


@triton.jit
def _l2_prefetch_kernel(base, nbytes, chunk, BLOCK: tl.constexpr):
    """Thread ``i`` prefetches bytes ``[i * chunk, min((i + 1) * chunk, nbytes))`` from the
    address ``base`` (int64); threads past the end issue nothing."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = i.to(tl.int64) * chunk
    size = tl.minimum(tl.maximum(nbytes - start, 0), chunk).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r",
        [base + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def l2_prefetch_supported(device: torch.device) -> bool:
    """Whether :func:`l2_prefetch` can run on ``device`` (CUDA, compute capability 9.0+,
    not the Triton interpreter)."""
    if device.type != "cuda" or is_interpreter():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def l2_prefetch_plan(nbytes: int, sms: int) -> tuple[int, int]:
    """(bytes a thread, programs) for prefetching ``nbytes`` (a multiple of ``ALIGN``):
    chunks of ``MIN_CHUNK`` to ``MAX_CHUNK`` bytes, over one program an SM where that
    suffices, so that the requests leave from many SMs at once."""
    chunk = triton.cdiv(triton.cdiv(nbytes, sms * THREADS), ALIGN) * ALIGN
    chunk = min(max(MIN_CHUNK, chunk), MAX_CHUNK)
    return chunk, triton.cdiv(triton.cdiv(nbytes, chunk), THREADS)


def dense_span(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the memory that a contiguous tensor, or a transposed
    contiguous matrix (a weight stored for a column-major GEMM), occupies; None for other
    layouts."""
    if t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous()):
        return t.data_ptr(), t.numel() * t.element_size()
    return None


def l2_prefetch(t: torch.Tensor) -> None:
    """Asks, on the current stream, for the memory ``t`` occupies (see
    :func:`dense_span`; the whole 16-byte units inside it) to be brought into L2. A
    hint: returns at once and changes no tensor."""
    span = dense_span(t)
    if span is None:
        raise ValueError(
            f"l2_prefetch needs a contiguous tensor or a transposed contiguous matrix, got "
            f"shape {tuple(t.shape)} with strides {t.stride()}"
        )
    address, nbytes = span
    base = -(-address // ALIGN) * ALIGN
    nbytes = (address + nbytes - base) // ALIGN * ALIGN
    if nbytes <= 0:
        return
    chunk, programs = l2_prefetch_plan(nbytes, num_sms(t.device))
    _l2_prefetch_kernel[(programs,)](base, nbytes, chunk, BLOCK=THREADS, num_warps=1)
