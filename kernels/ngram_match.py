"""N-gram (prompt lookup) matching on the device: one program per sequence.

Layout: ``history [S, C]`` int32, row ``slots[b]`` holding sequence ``b``'s tokens
``t[0..L-1]`` (``L = lengths[b]``, the rest of the row unused). For each sequence the
kernel finds the largest ``n`` in ``[min_n, max_n]`` such that the suffix ``t[L-n..L-1]``
also ends at some ``e <= L - 2``, the most recent such ``e``, and writes the ``k`` tokens
that followed it, continued periodically past the end (token ``e + 1 + j % (L - 1 - e)``):
the rule of ``server.spec_decode.ngram_proposer`` (whose ``ngram_lookup`` is the
reference). Output: int32 ``[B, k + 1]``, each row the drafts (-1 where nothing matched)
and then their number (``k`` or 0), so one copy brings a step's proposals back. The same
launch can first write each sequence's new tokens into its row: from the host
(``pack_inputs``), or straight from a verify step's output on the device
(``ngram_after_verify``: the accepted drafts and the target's token of each row, so the
next step's drafts are ready when the host reads the step).

Each program scans its sequence's ends in blocks, comparing the ``max_n`` tokens that end
at each against the suffix, and keeps the best (length, end) as one int64 score: a
proposal for a batch is one launch, whatever the batch and the lengths.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 256  # ends compared per loop iteration


FROM_HOST, FROM_VERIFY = 1, 2  # where the new tokens come from (the kernel's UPDATE)


@triton.jit(do_not_specialize=["b2", "stride_h", "stride_t"])
def _ngram_match_kernel(
    hist_ptr,
    in_ptr,
    out_ptr,
    tok_ptr,
    acc_ptr,
    b2,
    stride_h,
    stride_t,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    K: tl.constexpr,
    OUT_W: tl.constexpr,
    UPDATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(in_ptr + b)
    row = hist_ptr + slot * stride_h
    offs = tl.arange(0, BLOCK)
    if UPDATE == 2:
        # a verify row's emitted tokens (accepted drafts, then the target's) after the
        # row's ``upto`` tokens; the barrier makes them visible to the program's threads
        upto = tl.load(in_ptr + b2 + b)
        count = tl.load(acc_ptr + b).to(tl.int64) + 1
        for i in range(0, count, BLOCK):
            o = i + offs
            m = o < count
            tok = tl.load(tok_ptr + b * stride_t + o, mask=m, other=0)
            tl.store(row + upto + o, tok.to(tl.int32), mask=m)
        tl.debug_barrier()
        length = upto + count
        tl.store(out_ptr + b * OUT_W + K + 1, length.to(tl.int32))
    else:
        length = tl.load(in_ptr + b2 + b)
    if UPDATE == 1:
        # this sequence's new tokens into its row first (positions upto .. length - 1)
        upto = tl.load(in_ptr + 2 * b2 + b)
        new_ptr = in_ptr + 4 * b2 + tl.load(in_ptr + 3 * b2 + b)
        for i in range(0, length - upto, BLOCK):
            o = i + offs
            m = o < length - upto
            tok = tl.load(new_ptr + o, mask=m, other=0)
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
    tl.store(out_ptr + b * OUT_W + cols, tl.where(found, toks, -1))
    tl.store(out_ptr + b * OUT_W + K, tl.where(found, K, 0))


def pack_inputs(
    slots: np.ndarray,
    lengths: np.ndarray,
    upto: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The kernel's int64 input for ``B`` sequences, ``B2 = B`` rounded up to even (each
    part 16-byte aligned: one compiled kernel for every batch): ``[slots | lengths | upto
    | starts]``, ``B2`` each, then the new tokens. ``upto [B]``: the tokens each row holds
    already; ``tokens``: each sequence's tokens ``upto .. length - 1``, in order (None: no
    update). Written into ``out`` (e.g. a view of pinned memory) when given."""
    b = len(slots)
    b2 = b + (b & 1)
    n = 0 if tokens is None else len(tokens)
    buf = np.empty(4 * b2 + n, np.int64) if out is None else out[: 4 * b2 + n]
    head = buf[: 4 * b2].reshape(4, b2)
    head[0, :b], head[1, :b] = slots, lengths
    if tokens is not None:
        assert upto is not None
        new = lengths - upto
        head[2, :b] = upto
        np.cumsum(new, out=head[3, :b])
        head[3, :b] -= new
        buf[4 * b2 :] = tokens
    return buf


def ngram_match(
    history: torch.Tensor,
    packed: torch.Tensor,
    num_seqs: int,
    k: int,
    min_n: int,
    max_n: int,
    update: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``history [S, C]`` int32 and ``packed`` (``pack_inputs``, int64) -> int32
    ``[num_seqs, k + 1]``: each sequence's drafts (-1 where none) and, last, how many
    (``k`` or 0); see the module docstring. ``update``: first writes each sequence's new
    tokens into its row (the same launch). ``k`` must be a power of two (callers ask for
    the next one and cut). ``out``: a contiguous int32 buffer of at least
    ``num_seqs * (k + 1)`` values to write those rows into, returned as given. ``packed``
    and ``out`` may be pinned host memory, which the GPU reads and writes directly."""
    b = num_seqs
    if out is None:
        out = torch.empty((b, k + 1), dtype=torch.int32, device=history.device)
    _check(history, k, min_n, max_n, out, b * (k + 1))
    if packed.dtype != torch.int64 or packed.numel() < 4 * (b + (b & 1)):
        raise ValueError("packed must be pack_inputs' int64 buffer for num_seqs sequences")
    if b:
        how = FROM_HOST if update else 0
        _launch(history, packed, out, packed, packed, b, 0, k, k + 1, min_n, max_n, how)
    return out


def ngram_after_verify(
    history: torch.Tensor,
    staged: torch.Tensor,
    tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    k: int,
    min_n: int,
    max_n: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Appends each verify row's emitted tokens to its sequence's row and drafts from
    there, in one launch queued right after the rejection sampler: ``staged`` int64
    ``[slots | upto]`` (``B2`` each, ``B2 = N`` rounded up to even; ``upto``: the tokens
    the row holds), ``tokens [N, T]`` int64 and ``num_accepted [N]`` (the rejection
    sampler's output: row ``i`` emits ``tokens[i, :num_accepted[i] + 1]``, ``T >= that``).
    Writes int32 ``[N, k + 2]`` into ``out``: the drafts, their number (``k`` or 0), and
    the row's new length. ``k`` a power of two; the rows must be wide enough."""
    n = tokens.shape[0]
    _check(history, k, min_n, max_n, out, n * (k + 2))
    if tokens.dim() != 2 or tokens.stride(1) != 1 or num_accepted.shape != (n,):
        raise ValueError(f"tokens [N, T] row-major and num_accepted [N]: {tokens.shape}")
    if staged.dtype != torch.int64 or staged.numel() < 2 * (n + (n & 1)):
        raise ValueError("staged must hold int64 [slots | upto] for the N verify rows")
    if n:
        _launch(
            history, staged, out, tokens, num_accepted, n, tokens.stride(0), k, k + 2,
            min_n, max_n, FROM_VERIFY,
        )  # fmt: skip
    return out


def _check(
    history: torch.Tensor, k: int, min_n: int, max_n: int, out: torch.Tensor, need: int
) -> None:
    """ValueError unless the arguments both launchers share are usable (``out``: at
    least ``need`` int32 values, contiguous)."""
    if history.dtype != torch.int32 or history.dim() != 2 or history.stride(1) != 1:
        raise ValueError(f"history must be a row-major [S, C] int32 tensor, got {history.dtype}")
    if k < 1 or k & (k - 1):
        raise ValueError(f"k={k}: must be a power of two")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"min_n={min_n}, max_n={max_n}: need 1 <= min_n <= max_n")
    if out.dtype != torch.int32 or out.numel() < need or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 buffer of >= {need} values")


def _launch(
    history: torch.Tensor,
    packed: torch.Tensor,
    out: torch.Tensor,
    tokens: torch.Tensor,
    accepted: torch.Tensor,
    b: int,
    stride_t: int,
    k: int,
    out_w: int,
    min_n: int,
    max_n: int,
    update: int,
) -> None:
    """One launch (``update``: 0, FROM_HOST or FROM_VERIFY)."""
    _ngram_match_kernel[(b,)](
        history,
        packed,
        out,
        tokens,
        accepted,
        b + (b & 1),
        history.stride(0),
        stride_t,
        MIN_N=min_n,
        MAX_N=max_n,
        K=k,
        OUT_W=out_w,
        UPDATE=update,
        BLOCK=BLOCK,
        num_warps=4,
    )
