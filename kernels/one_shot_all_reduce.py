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
  3. waits (acquire, system scope) until every ``signals_i[r, j]`` is ``epoch`` or
     ``epoch + 1`` (int32, wrapping: the peer may be one launch of the row ahead);
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
one stream run in order). A flag may move on by one epoch before its reader looks, and
the rows of that later epoch are in the other slot; it never moves on by two. It may lag
by any number of launches when some of the row's launches moved as flagged words (below),
which send no flag, so the wait tests for those two values, not for ``flag - epoch >=
0``: a flag 2**31 launches back, or the 0 it starts at once the count has wrapped to
negative epochs, would pass that test before the peer's row is in (only a lag of 2**32 - 1
or 2**32 launches fools the equality). All state is on the device (no host-side
counter), so CUDA graphs replay it as is.
Every rank must launch the same sequence of row counts (tensor-parallel ranks run the
same steps); a rank that never arrives leaves the others waiting, as NCCL would.

Flagged words (``LL``, NCCL's LL protocol in kind; sums of up to ``LL_MAX_ROWS`` rows; on
unless ``KVSCALE_ALLREDUCE_LL=0``: TP=2 C 2.986 -> 2.950 ms on 2 x H200, NOTES "e61 and e62
measured"): a third region of the buffer, ``[2, ll_rows, W, H * itemsize / 4]`` int64,
holds each row as 4-byte words, each stored with the launch's epoch in the other 4 bytes of
an 8-byte word (written and read whole). Steps 2-3 become: write the flagged words of row r
into ``ll_j[slot, r, i]``, then poll the words in ``ll_i[slot, r, j]`` (volatile loads)
until every one carries ``epoch``. No flag, no release fence that waits for the row's
writes to land, no separate load after the wait: the data is what is polled. Twice the
row's bytes cross the link, hence small sums only. The two-slot argument above holds as is
(a slot's words carry this epoch or one two launches old).

r18/r19 (2 x H200) ran the earlier *pull* version of this kernel (each rank copied its
row into its own buffer, compare-and-swapped a flag in each peer's memory and read the
peers' rows over NVLink: two round trips to another GPU per launch).
"""

from __future__ import annotations

import os

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
# Sums of up to this many rows can move as flagged words (``LL``): each 8-byte word holds 4
# bytes of the row and the launch's epoch, so a reader polls the data itself, and the
# writer sends no flag and waits on no system-scope fence. Twice the bytes of the row on
# the link, so only for small sums (NOTES e62).
LL_MAX_ROWS = 16
USE_LL = os.environ.get("KVSCALE_ALLREDUCE_LL", "1") == "1"  # NOTES "e61 and e62 measured"


def data_bytes_per_row(hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one row's data slots in a rank's buffer (both slots, every rank's copy)."""
    return SLOTS * world_size * hidden * dtype.itemsize


def signal_offset(max_rows: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Byte offset of the signals in a buffer of :func:`buffer_bytes`: after the data
    slots, rounded up to 16 bytes."""
    data = max_rows * data_bytes_per_row(hidden, dtype, world_size)
    return -(-data // 16) * 16


def ll_offset(max_rows: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Byte offset of the flagged-word slots (``LL``) in a buffer of :func:`buffer_bytes`:
    after the signals, rounded up to 16 bytes."""
    end = signal_offset(max_rows, hidden, dtype, world_size) + max_rows * world_size * 4
    return -(-end // 16) * 16


def ll_rows(max_rows: int) -> int:
    """Rows the flagged-word slots hold: sums of up to this many rows can take them."""
    return min(max_rows, LL_MAX_ROWS)


def buffer_bytes(max_rows: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one rank's symmetric buffer: the data slots, ``[max_rows, W]`` int32
    signals, then ``[2, ll_rows, W, H * itemsize / 4]`` int64 flagged words."""
    words = hidden * dtype.itemsize // 4
    ll = SLOTS * ll_rows(max_rows) * world_size * words * 8
    return ll_offset(max_rows, hidden, dtype, world_size) + ll


def row_alignment(hidden: int, elem_bytes: int) -> int:
    """Elements per 16 bytes when every row of the buffer starts on a 16-byte boundary
    (the buffer's base is; rows are ``hidden`` apart), else 1. Without it Triton cannot
    tell the alignment of an address loaded from memory and moves rows 2 bytes at a time
    (its PTX for sm_90: 16 scalar loads a thread where 1 vector load will do; r18's
    one-shot time grew ~0.2 us a row)."""
    per = 16 // elem_bytes
    return per if hidden % per == 0 else 1


@triton.jit
def _ll_unpack(v, dtype, EPW: tl.constexpr, BLOCK: tl.constexpr):
    """The row's elements ``[BLOCK]`` in ``dtype`` from flagged words ``v [BLOCK / EPW]``
    int64 (low 4 bytes: ``EPW`` elements, the first in the low bits)."""
    lo = (v & 0xFFFFFFFF).to(tl.int32)
    # if / else, not an early return: Triton compiles the statements after a constexpr
    # if's return too, and a 16-bit bitcast of fp32 does not compile
    if EPW == 1:
        out = lo.to(dtype, bitcast=True)
    else:
        first = (lo & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
        second = ((lo >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
        out = tl.reshape(tl.join(first, second), [BLOCK])
    return out


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
    ll_offset,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    NORM: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
    LL: tl.constexpr,
    LL_ROWS: tl.constexpr,
    EPW: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = x_ptr.dtype.element_ty
    use = tl.load(uses_ptr + row)
    epoch = use + 1
    if NORM:  # local: in flight while the peers' rows arrive
        r, w = load_norm_operands(res_ptr + row * stride_r, w_ptr, offs, mask)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    if LL:
        # the row as 4-byte words, each sent with the epoch in an 8-byte word: the reader
        # knows a word has arrived by its epoch, so nothing orders the words or flags them
        WORDS: tl.constexpr = BLOCK // EPW
        offs_w = tl.arange(0, WORDS)
        w_mask = offs_w < hidden // EPW
        x_words = x_ptr.to(tl.pointer_type(tl.int32)) + row * (stride_x // EPW)
        words = tl.load(x_words + offs_w, mask=w_mask, other=0)
        packed = (epoch.to(tl.int64) << 32) | (words.to(tl.int64) & 0xFFFFFFFF)
        slot_row = ((use & 1) * LL_ROWS + row).to(tl.int64) * WORLD  # ll[slot, row, 0]
        words_per_row = hidden // EPW
        for j in tl.static_range(WORLD):
            if j != RANK:
                peer = (tl.load(data_ptrs + j) + ll_offset).to(tl.pointer_type(tl.int64))
                tl.store(peer + (slot_row + RANK) * words_per_row + offs_w, packed, mask=w_mask)
        mine = (tl.load(data_ptrs + RANK) + ll_offset).to(tl.pointer_type(tl.int64))
        for j in tl.static_range(WORLD):
            if j == RANK:  # the row as sent: no second load of x
                acc += _ll_unpack(packed, dtype, EPW, BLOCK).to(tl.float32)
            else:
                at = mine + (slot_row + j) * words_per_row + offs_w
                v = tl.load(at, mask=w_mask, other=0, volatile=True)
                # a slot's words hold this epoch or one two launches old (a peer cannot
                # be two launches ahead: it needs this rank's row of the launch between)
                while tl.max((((v >> 32).to(tl.int32) != epoch) & w_mask).to(tl.int32), 0) > 0:
                    v = tl.load(at, mask=w_mask, other=0, volatile=True)
                acc += _ll_unpack(v, dtype, EPW, BLOCK).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        base = ((use & 1) * max_rows + row).to(tl.int64) * WORLD  # data[slot, row, 0]
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
                ahead = tl.atomic_add(flag, 0, sem="acquire", scope="sys") - epoch
                while (ahead != 0) & (ahead != 1):
                    ahead = tl.atomic_add(flag, 0, sem="acquire", scope="sys") - epoch
        tl.debug_barrier()  # no thread reads a peer's row before its flag is in
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


def ll_fits(x: torch.Tensor, max_rows: int) -> bool:
    """Whether the sum of ``x [T, H]`` can move as flagged words: at most
    :func:`ll_rows` rows, and its rows read as whole 4-byte words."""
    row_bytes, stride_bytes = x.shape[1] * x.element_size(), x.stride(0) * x.element_size()
    return (
        x.shape[0] <= ll_rows(max_rows)
        and row_bytes % 4 == 0
        and stride_bytes % 4 == 0
        and x.data_ptr() % 4 == 0
    )


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
    ll: bool | None = None,
) -> None:
    """In place over ``x [T, H]`` (T <= ``max_rows``, last dim contiguous): x <- the sum of
    every rank's x; with ``residual [T, H]`` and ``weight [H]``: residual <- sum +
    residual and x <- weight * rms_norm(residual, eps) (module docstring).

    ``data_ptrs``/``signal_ptrs``: ``[W]`` int64 device addresses of each rank's data
    slots and signals; ``uses``: ``[max_rows]`` int32, this rank's. ``ll``: sums that
    :func:`ll_fits` move as flagged words (None: ``USE_LL``); every rank must choose
    alike."""
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
        ll_offset(max_rows, hidden, x.dtype, world),
        RANK=rank,
        WORLD=world,
        NORM=norm,
        ALIGN=row_alignment(hidden, x.element_size()),
        LL=(USE_LL if ll is None else ll) and ll_fits(x, max_rows),
        LL_ROWS=ll_rows(max_rows),
        EPW=max(1, 4 // x.element_size()),
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
