"""One-shot all-reduce over peer-mapped GPU memory, optionally fused with the residual add
and RMSNorm that follow a row-parallel layer.

For the tensor-parallel ranks of one node whose GPUs read and write each other's memory
(NVLink or PCIe peer access). Every rank allocates the same *symmetric* buffer and knows
the device address of every rank's copy (``server/distributed/one_shot.py`` sets it up):

    data:     ``[2, max_rows, W, H]`` in the activation dtype: two slots per row, and in
              each the row as every rank sent it
    signals:  ``[max_rows, W]`` int32, 0 at first; ``signals_i[r, j]`` is the epoch (the
              launch count of row r, 1-based) of the last row r that rank j sent rank i
    uses:     ``[max_rows]`` int32, this rank's own count of the launches that held row r
              (never read by the other ranks)

Program r (one per row) of rank i, for ``x [T, H]`` with T <= max_rows (*push*: every
access to another GPU's memory is a write, which does not wait for an answer):
  1. ``use = uses[r]``, ``slot = use & 1``, ``epoch = use + 1`` (int32, wrapping);
  2. writes row r of x into ``data_j[slot, r, i]`` of every other rank j, then (release,
     system scope) ``epoch`` into ``signals_j[r, i]``;
  3. waits (acquire, system scope) until every ``signals_i[r, j]`` has reached ``epoch``
     (compared as ``flag - epoch >= 0``, so the count may wrap);
  4. sums its own row and the rows in its own ``data_i[slot, r, j]`` in rank order, in
     fp32, rounded to the dtype: every rank gets the same bits (the sum NCCL returns for
     two ranks);
  5. without a norm: x <- the sum. With one (``residual``, ``weight``): as
     ``fused_add_rms_norm(sum, residual, weight, eps)`` (kernels/rmsnorm.py), bit for bit:
     residual <- sum + residual, x <- weight * rms_norm(residual);
  6. ``uses[r] = use + 1``.

Why this is safe with two slots and no acknowledgement: rank i writes ``data_j[slot, r,
i]`` again two launches of row r later, after waiting (launch between) for rank j's
epoch, which rank j sent after its launch that read the slot had finished (launches on
one stream run in order). A flag may move on by one epoch before its reader looks (the
reader needs "reached", not "equal"), and the rows of that later epoch are in the other
slot. All state is on the device (no host-side counter), so CUDA graphs replay it as is.
Every rank must launch the same sequence of row counts (tensor-parallel ranks run the
same steps); a rank that never arrives leaves the others waiting, as NCCL would.

r18/r19 (2 x H200) ran the earlier *pull* version of this kernel (each rank copied its
row into its own buffer, compare-and-swapped a flag in each peer's memory and read the
peers' rows over NVLink: two round trips to another GPU per launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels.rmsnorm import (
    add_rms_norm_row,
    fused_add_rms_norm_ref,
    load_norm_operands,
    row_launch_opts,
)

SLOTS = 2


def data_bytes_per_row(hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one row's data slots in a rank's buffer (both slots, every rank's copy)."""
    return SLOTS * world_size * hidden * dtype.itemsize


def signal_offset(max_rows: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Byte offset of the signals in a buffer of :func:`buffer_bytes`: after the data
    slots, rounded up to 16 bytes."""
    data = max_rows * data_bytes_per_row(hidden, dtype, world_size)
    return -(-data // 16) * 16


def buffer_bytes(max_rows: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one rank's symmetric buffer: the data slots, then ``[max_rows, W]`` int32
    signals."""
    return signal_offset(max_rows, hidden, dtype, world_size) + max_rows * world_size * 4


def row_alignment(hidden: int, elem_bytes: int) -> int:
    """Elements per 16 bytes when every row of the buffer starts on a 16-byte boundary
    (the buffer's base is; rows are ``hidden`` apart), else 1. Without it Triton cannot
    tell the alignment of an address loaded from memory and moves rows 2 bytes at a time
    (its PTX for sm_90: 16 scalar loads a thread where 1 vector load will do; r18's
    one-shot time grew ~0.2 us a row)."""
    per = 16 // elem_bytes
    return per if hidden % per == 0 else 1


@triton.jit
def _one_shot_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    data_ptrs,
    signal_ptrs,
    uses_ptr,
    hidden,
    max_rows,
    eps,
    stride_x,
    stride_r,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    NORM: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = x_ptr.dtype.element_ty
    use = tl.load(uses_ptr + row)
    epoch = use + 1
    base = ((use & 1) * max_rows + row).to(tl.int64) * WORLD  # data[slot, row, 0]
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if NORM:  # local: in flight while the peers' rows arrive
        r, w = load_norm_operands(res_ptr + row * stride_r, w_ptr, offs, mask)
    mine = tl.multiple_of(tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype)), 16)
    sent = (base + RANK) * hidden  # where the peers keep this rank's row
    if ALIGN > 1:  # rows start on 16-byte boundaries: 16-byte loads and stores
        sent = tl.multiple_of(sent, ALIGN)
    for j in tl.static_range(WORLD):
        if j != RANK:
            peer = tl.multiple_of(tl.load(data_ptrs + j).to(tl.pointer_type(dtype)), 16)
            tl.store(peer + sent + offs, x, mask=mask)
    tl.debug_barrier()  # the whole row is on its way before the flags go out
    for j in tl.static_range(WORLD):
        if j != RANK:
            theirs = tl.load(signal_ptrs + j).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(theirs + row * WORLD + RANK, epoch, sem="release", scope="sys")
    my_signals = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for j in tl.static_range(WORLD):
        if j != RANK:
            flag = my_signals + row * WORLD + j
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") - epoch < 0:
                pass
    tl.debug_barrier()  # no thread reads a peer's row before its flag is in
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(WORLD):
        if j == RANK:
            acc += x.to(tl.float32)
        else:
            at = (base + j) * hidden
            if ALIGN > 1:
                at = tl.multiple_of(at, ALIGN)
            acc += tl.load(mine + at + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    total = acc.to(dtype).to(tl.float32)
    if NORM:
        add_rms_norm_row(
            total, r, w, res_ptr + row * stride_r, x_ptr + row * stride_x, offs, mask, hidden, eps
        )
    else:
        tl.store(x_ptr + row * stride_x + offs, total.to(dtype), mask=mask)
    tl.store(uses_ptr + row, epoch)


def one_shot_all_reduce(
    x: torch.Tensor,
    data_ptrs: torch.Tensor,
    signal_ptrs: torch.Tensor,
    uses: torch.Tensor,
    rank: int,
    max_rows: int,
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """In place over ``x [T, H]`` (T <= ``max_rows``, last dim contiguous): x <- the sum of
    every rank's x; with ``residual [T, H]`` and ``weight [H]``: residual <- sum +
    residual and x <- weight * rms_norm(residual, eps) (module docstring).

    ``data_ptrs``/``signal_ptrs``: ``[W]`` int64 device addresses of each rank's data
    slots and signals; ``uses``: ``[max_rows]`` int32, this rank's."""
    rows, hidden = x.shape
    world = data_ptrs.shape[0]
    if rows > max_rows:
        raise ValueError(f"one-shot all-reduce of {rows} rows: at most {max_rows}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dim")
    norm = residual is not None
    if norm:
        assert weight is not None and residual is not None
        if residual.shape != x.shape or weight.shape != (hidden,) or residual.stride(-1) != 1:
            raise ValueError("residual must be x's shape (last dim contiguous), weight [H]")
    if rows == 0:
        return
    _one_shot_kernel[(rows,)](
        x,
        residual if norm else x,
        weight if norm else x,
        data_ptrs,
        signal_ptrs,
        uses,
        hidden,
        max_rows,
        eps,
        x.stride(0),
        residual.stride(0) if norm else 0,
        RANK=rank,
        WORLD=world,
        NORM=norm,
        ALIGN=row_alignment(hidden, x.element_size()),
        **row_launch_opts(hidden),
    )


def all_reduce_add_rms_norm_ref(
    parts: list[torch.Tensor],
    residual: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """What every rank's x holds afterwards, from every rank's ``[T, H]`` part (rank
    order); ``residual`` is updated in place as the kernel does."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        total += p.float()
    out = total.to(parts[0].dtype)
    if residual is not None:
        assert weight is not None
        fused_add_rms_norm_ref(out, residual, weight, eps)
    return out
