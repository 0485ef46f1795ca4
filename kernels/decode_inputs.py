"""A decode step's inputs into the decode CUDA graphs' static buffers, in one launch.

Before a replay, the step's device inputs (one packed host-to-device copy) are copied into
the buffers the graph was captured on, and each placeholder token id ``-(r + 1)`` (the
token the step before sampled for row ``r``, not yet known on the host) becomes
``last_tokens[r]``. Done with tensor ops that is five copies and six small kernels (a
batch-1 decode step on an H100: ~16 us of GPU time and eleven launches); here it is one
launch of one program a row.

Layouts (``bs`` rows, ``W`` table columns, ``W <=`` the static table's width):
    ids, positions, slots: ``[bs]`` int64; seq_lens: ``[bs]`` int32; tables: ``[bs, W]``
    int32 (rows contiguous); last_tokens: ``[R]`` int64 (R > every placeholder's row).
    The static buffers: the same dtypes, at least ``bs`` rows; the table's columns past
    ``W`` keep what they held (kernels never read past a row's length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscale.kernels._utils import next_power_of_2


# Sizes that change every step are not specialized on, so no step recompiles.
@triton.jit(do_not_specialize=["width", "stride_t"])
def _decode_inputs_kernel(
    ids_ptr,
    pos_ptr,
    slots_ptr,
    lens_ptr,
    tables_ptr,
    last_ptr,
    out_ids_ptr,
    out_pos_ptr,
    out_slots_ptr,
    out_lens_ptr,
    out_tables_ptr,
    width,
    stride_t,
    stride_out_t,
    BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0)
    tok = tl.load(ids_ptr + r)
    held = tl.where(tok < 0, -tok - 1, 0)  # the placeholder's row (0: unused)
    last = tl.load(last_ptr + held, mask=tok < 0, other=0)
    tl.store(out_ids_ptr + r, tl.where(tok < 0, last, tok))
    tl.store(out_pos_ptr + r, tl.load(pos_ptr + r))
    tl.store(out_slots_ptr + r, tl.load(slots_ptr + r))
    tl.store(out_lens_ptr + r, tl.load(lens_ptr + r))
    row = tables_ptr + r.to(tl.int64) * stride_t
    out_row = out_tables_ptr + r.to(tl.int64) * stride_out_t
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        keep = cols < width
        tl.store(out_row + cols, tl.load(row + cols, mask=keep, other=0), mask=keep)


def load_decode_inputs(
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    tables: torch.Tensor,
    last_tokens: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Writes rows ``[:bs]`` of ``out`` = (ids, positions, slots, seq_lens, tables) from
    the step's inputs, each placeholder id resolved from ``last_tokens`` (module doc)."""
    out_ids, out_pos, out_slots, out_lens, out_tables = out
    bs, width = tables.shape
    if any(t.shape != (bs,) for t in (ids, positions, slots, seq_lens)):
        raise ValueError(
            f"ids, positions, slots and seq_lens must be [{bs}] (the table's rows); got "
            f"{tuple(ids.shape)}, {tuple(positions.shape)}, {tuple(slots.shape)}, "
            f"{tuple(seq_lens.shape)}"
        )
    if out_ids.shape[0] < bs or out_tables.shape[1] < width:
        raise ValueError(
            f"the static buffers hold {out_ids.shape[0]} rows x {out_tables.shape[1]} table "
            f"columns; the step needs {bs} x {width}"
        )
    for name, t in (("ids", ids), ("positions", positions), ("slots", slots),
                    ("seq_lens", seq_lens)):  # fmt: skip
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if bs == 0:
        return
    if tables.stride(1) != 1 or out_tables.stride(1) != 1:
        raise ValueError("the tables' rows must be contiguous")
    _decode_inputs_kernel[(bs,)](
        ids, positions, slots, seq_lens, tables, last_tokens,
        out_ids, out_pos, out_slots, out_lens, out_tables,
        width, tables.stride(0), out_tables.stride(0),
        BLOCK_W=min(1024, max(16, next_power_of_2(width))),
        num_warps=1,
    )  # fmt: skip
