"""N-gram (prompt lookup) matching on the device: one program per sequence.

Layout: ``history [S, C]`` int32, row ``slots[b]`` holding sequence ``b``'s tokens
``t[0..L-1]`` (``L = lengths[b]``, the rest of the row unused). For each sequence the
kernel finds the largest ``n`` in ``[min_n, max_n]`` such that the suffix ``t[L-n..L-1]``
also ends at some ``e <= L - 2``, the most recent such ``e``, and writes the ``k`` tokens
that followed it, continued periodically past the end (token ``e + 1 + j % (L - 1 - e)``):
the rule of ``server.spec_decode.ngram_proposer`` (whose ``ngram_lookup`` is the
reference). Output: int32 ``[B, k + 1]``, each row the drafts (-1 where nothing matched)
and then their number (``k`` or 0), so one copy brings a step's proposals back. The same
launch can first write each sequence's new tokens into its row.

Each program scans its sequence's ends in blocks, comparing the ``max_n`` tokens that end
at each against the suffix, and keeps the best (length, end) as one int64 score: a
proposal for a batch is one launch, whatever the batch and the lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256  # ends compared per loop iteration


@triton.jit(do_not_specialize=["num_seqs", "stride_h"])
def _ngram_match_kernel(
    hist_ptr,
    slot_ptr,
    len_ptr,
    upto_ptr,
    start_ptr,
    new_ptr,
    out_ptr,
    num_seqs,
    stride_h,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    K: tl.constexpr,
    UPDATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    length = tl.load(len_ptr + b).to(tl.int64)
    row = hist_ptr + slot * stride_h
    offs = tl.arange(0, BLOCK)
    if UPDATE:
        # this sequence's new tokens into its row first (positions upto .. length - 1);
        # the barrier makes them visible to the program's other threads
        upto = tl.load(upto_ptr + b).to(tl.int64)
        start = tl.load(start_ptr + b).to(tl.int64)
        for i in range(0, length - upto, BLOCK):
            o = i + offs
            m = o < length - upto
            tok = tl.load(new_ptr + start + o, mask=m, other=0)
            tl.store(row + upto + o, tok.to(tl.int32), mask=m)
        tl.debug_barrier()
    best = tl.full((), -1, tl.int64)
    for first in range(0, length - 1, BLOCK):
        ends = first + offs
        valid = ends <= length - 2
        run = valid
        mlen = tl.zeros((BLOCK,), tl.int64)
        for j in tl.static_range(MAX_N):
            # the suffix's j-th token from the end (-2: the sequence is shorter)
            tail_pos = length - 1 - j
            tail = tl.load(row + tl.maximum(tail_pos, 0))
            tail = tl.where(tail_pos >= 0, tail, -2)
            x = tl.load(row + ends - j, mask=valid & (ends - j >= 0), other=-3)
            run = run & (x == tail)
            mlen += run.to(tl.int64)
        score = tl.where(valid & (mlen >= MIN_N), mlen * (1 << 40) + ends, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    found = best >= 0
    end = best % (1 << 40)
    period = tl.maximum(length - 1 - end, 1)
    cols = tl.arange(0, K)
    idx = end + 1 + cols % period
    toks = tl.load(row + idx, mask=found & (idx < length), other=-1)
    tl.store(out_ptr + b * (K + 1) + cols, tl.where(found, toks, -1))
    tl.store(out_ptr + b * (K + 1) + K, tl.where(found, K, 0))


def ngram_match(
    history: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    min_n: int,
    max_n: int,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``history [S, C]`` int32, ``slots [B]`` and ``lengths [B]`` (int32 or int64) on its
    device -> int32 ``[B, k + 1]``: each sequence's drafts (-1 where none) and, last, how
    many (``k`` or 0); see the module docstring. ``k`` must be a power of two (callers ask
    for the next one and cut). ``new = (upto [B], starts [B], tokens [N])``: first writes
    sequence ``b``'s tokens ``upto[b] .. lengths[b] - 1``, found at ``tokens[starts[b]:]``,
    into its row (the same launch). ``out``: where to write the result (e.g. pinned host
    memory, which the GPU writes directly); the inputs may be pinned host memory too."""
    if history.dtype != torch.int32 or history.dim() != 2 or history.stride(1) != 1:
        raise ValueError(f"history must be a row-major [S, C] int32 tensor, got {history.dtype}")
    if k < 1 or k & (k - 1):
        raise ValueError(f"k={k}: must be a power of two")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"min_n={min_n}, max_n={max_n}: need 1 <= min_n <= max_n")
    b = slots.shape[0]
    if out is None:
        out = torch.empty((b, k + 1), dtype=torch.int32, device=history.device)
    elif out.shape != (b, k + 1) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 [{b}, {k + 1}], got {out.shape}")
    upto, starts, tokens = new if new is not None else (lengths, lengths, lengths)
    if b:
        _ngram_match_kernel[(b,)](
            history,
            slots,
            lengths,
            upto,
            starts,
            tokens,
            out,
            b,
            history.stride(0),
            MIN_N=min_n,
            MAX_N=max_n,
            K=k,
            UPDATE=new is not None,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out
