"""N-gram (prompt lookup) proposer: drafts the tokens that followed the longest earlier
occurrence of the sequence's own suffix in its prompt and output. No model, host only,
vectorised over the batch with numpy.

For each sequence of tokens ``t[0..L-1]`` it finds the largest ``n`` in
``[min_n, max_n]`` such that the suffix ``t[L-n..L-1]`` also occurs ending at some
``e <= L - 2`` (so at least one token follows it); among the occurrences of that length it
takes the most recent (largest ``e``) and proposes ``t[e+1 .. e+k]``, clipped to the
sequence (fewer than ``k`` when the match ends near the end; none when no suffix of at
least ``min_n`` tokens recurs).

The work is ``max_n`` elementwise compares over a ``[B, L]`` array (end-aligned: the match
length at each end position grows one compared token at a time), so its cost is linear in
the batch's tokens and independent of ``k``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, k: int, min_n: int = 1, max_n: int = 4) -> None:
        if k < 1:
            raise ValueError(f"num_speculative_tokens={k}: must be >= 1")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min={min_n}, max={max_n}: need 1 <= min <= max")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(
        self, sequences: Sequence[Sequence[int] | np.ndarray], k: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(drafts [B, k] int64, padded with -1; num_drafts [B] int64)``."""
        k = self.k if k is None else k
        b = len(sequences)
        lens = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=b)
        drafts = np.full((b, k), -1, dtype=np.int64)
        if b == 0 or lens.max(initial=0) < 2:
            return drafts, np.zeros(b, dtype=np.int64)
        width = int(lens.max())
        tok = np.full((b, width), -1, dtype=np.int64)
        for i, s in enumerate(sequences):
            tok[i, : lens[i]] = s
        rows = np.arange(b)
        ends = np.arange(width)
        run = np.ones((b, width), dtype=bool)
        mlen = np.zeros((b, width), dtype=np.int64)
        for j in range(self.max_n):
            # the suffix's j-th token from the end; -2 where the sequence is shorter
            tail_pos = lens - 1 - j
            tail = np.where(tail_pos >= 0, tok[rows, np.maximum(tail_pos, 0)], -2)
            shifted = np.full((b, width), -3, dtype=np.int64)
            shifted[:, j:] = tok[:, : width - j]
            run &= shifted == tail[:, None]
            mlen += run
            if not run.any():
                break
        valid_end = ends[None, :] <= (lens - 2)[:, None]
        mlen = np.where(valid_end, mlen, 0)
        best = mlen.max(axis=1)
        # the most recent end position with the best length
        last = width - 1 - np.argmax((mlen == best[:, None])[:, ::-1], axis=1)
        found = best >= self.min_n
        idx = last[:, None] + 1 + np.arange(k)[None, :]
        ok = found[:, None] & (idx < lens[:, None])
        drafts = np.where(ok, tok[rows[:, None], np.minimum(idx, width - 1)], -1)
        return drafts, ok.sum(axis=1).astype(np.int64)
