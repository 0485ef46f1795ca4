"""One-shot all-reduce over peer-mapped GPU memory, optionally fused with the residual add
and RMSNorm that follow a row-parallel layer.

For the tensor-parallel ranks of one node whose GPUs read each other's memory (NVLink
or PCIe peer access). Every rank allocates the same *symmetric* buffer and knows the
device address of every rank's copy (``server/distributed/one_shot.py`` sets it up):

    data:     ``[2, max_rows, H]`` in the activation dtype: two slots per row
    signals:  ``[max_rows, W]`` int32, 0 at rest; ``signals_i[r, j]`` is 1 while rank j's
              flag for row r waits for rank i to take it
    uses:     ``[max_rows]`` int32, this rank's own count of the launches that held row r
              (never read by the other ranks)

Program r (one per row) of rank i, for ``x [T, H]`` with T <= max_rows:
  1. ``slot = uses[r] % 2``; copies row r of x into its own ``data[slot, r]``;
  2. meets program r of every other rank j: compare-and-swaps ``signals_j[r, i]`` from 0
     to 1 (release, system scope; retried while rank j has not taken the previous flag
     yet), then ``signals_i[r, j]`` from 1 back to 0 (acquire) once rank j's flag is there;
  3. sums ``data_j[slot, r]`` over j = 0..W-1 in rank order, in fp32, and rounds it to the
     dtype: every rank gets the same bits (the sum NCCL returns for two ranks);
  4. without a norm: x <- the sum. With one (``residual``, ``weight``): as
     ``fused_add_rms_norm(sum, residual, weight, eps)`` (kernels/rmsnorm.py), bit for bit:
     residual <- sum + residual, x <- weight * rms_norm(residual);
  5. ``uses[r] += 1``.

One meeting per launch is enough: a rank writes ``data[slot, r]`` again two launches of
row r later, after the meeting of the launch between, and every peer's flag for that
meeting was sent after the peer's previous launch (the one reading the slot) finished.
All state is on the device (no host-side counter), so CUDA graphs replay it as is. Every
rank must launch the same sequence of row counts (tensor-parallel ranks run the same
steps); a rank that never arrives leaves the others waiting, as NCCL would.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels.rmsnorm import add_rms_norm_row, fused_add_rms_norm_ref, row_launch_opts

SLOTS = 2


def signal_offset(max_rows: int, hidden: int, dtype: torch.dtype) -> int:
    """Byte offset of the signals in a buffer of :func:`buffer_bytes`: after the data
    slots, rounded up to 16 bytes."""
    data = SLOTS * max_rows * hidden * torch.empty((), dtype=dtype).element_size()
    return -(-data // 16) * 16


def buffer_bytes(max_rows: int, hidden: int, dtype: torch.dtype, world_size: int) -> int:
    """Bytes of one rank's symmetric buffer: the data slots, then ``[max_rows, W]`` int32
    signals."""
    return signal_offset(max_rows, hidden, dtype) + max_rows * world_size * 4


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
    at = ((use % 2) * max_rows + row).to(tl.int64) * hidden
    if ALIGN > 1:  # rows start on 16-byte boundaries: 16-byte loads and stores
        at = tl.multiple_of(at, ALIGN)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    mine = tl.load(data_ptrs + RANK).to(tl.pointer_type(dtype))
    mine = tl.multiple_of(mine, 16)  # symmetric allocations are 16-byte aligned at least
    tl.store(mine + at + offs, x, mask=mask)
    tl.debug_barrier()  # the whole row is written before the flag goes out
    my_signals = tl.load(signal_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for j in tl.static_range(WORLD):
        if j != RANK:
            theirs = tl.load(signal_ptrs + j).to(tl.pointer_type(tl.int32))
            flag = theirs + row * WORLD + RANK
            while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                pass
    for j in tl.static_range(WORLD):
        if j != RANK:
            flag = my_signals + row * WORLD + j
            while tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads a peer's row before the flags are in
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(WORLD):
        if j == RANK:
            acc += x.to(tl.float32)
        else:
            peer = tl.multiple_of(tl.load(data_ptrs + j).to(tl.pointer_type(dtype)), 16)
            acc += tl.load(peer + at + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    total = acc.to(dtype).to(tl.float32)
    if NORM:
        add_rms_norm_row(
            total, res_ptr + row * stride_r, w_ptr, x_ptr + row * stride_x, offs, mask, hidden, eps
        )
    else:
        tl.store(x_ptr + row * stride_x + offs, total.to(dtype), mask=mask)
    tl.store(uses_ptr + row, use + 1)


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
