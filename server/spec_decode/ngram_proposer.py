"""N-gram (prompt lookup) proposer: drafts the tokens that followed the longest earlier
occurrence of the sequence's own suffix in its prompt and output. No model, host only.

For each sequence of tokens ``t[0..L-1]`` it finds the largest ``n`` in
``[min_n, max_n]`` such that the suffix ``t[L-n..L-1]`` also occurs ending at some
``e <= L - 2`` (so at least one token follows it); among the occurrences of that length it
takes the most recent (largest ``e``) and proposes the ``k`` tokens that followed it,
``t[e+1 .. e+k]``; where that runs past the sequence's end it continues periodically
(token ``e+1+j`` for ``j`` modulo the period ``L-1-e``), as a sequence that repeats a
pattern would go on (none when no suffix of at least ``min_n`` tokens recurs).

Two implementations of that rule:

- ``ngram_lookup``: stateless, vectorised with numpy over a ``[B, L]`` array (``max_n``
  elementwise compares; linear in the batch's tokens, independent of ``k``). The
  reference, and the right tool for a one-off batch.
- ``NgramProposer`` (the engine's ``Proposer``): per sequence, a dict per ``n`` from each
  n-gram to its latest end position, extended with the tokens accepted since the last
  call (the engine's token lists only grow). A proposal is then ``max_n - min_n + 1`` dict
  lookups, so its cost does not grow with the sequence: a few microseconds a sequence.
  A sequence's first call indexes its prompt at C speed (``zip`` of shifted slices).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvscale.server.spec_decode.proposer import DraftRequest, Proposal


def _check(k: int, min_n: int, max_n: int) -> None:
    if k < 1:
        raise ValueError(f"num_speculative_tokens={k}: must be >= 1")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt_lookup_min={min_n}, max={max_n}: need 1 <= min <= max")


def ngram_lookup(
    sequences: Sequence[Sequence[int] | np.ndarray], k: int, min_n: int = 1, max_n: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(drafts [B, k] int64, padded with -1; num_drafts [B] int64)``."""
    _check(k, min_n, max_n)
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
    for j in range(max_n):
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
    found = best >= min_n
    period = np.maximum(lens - 1 - last, 1)
    idx = last[:, None] + 1 + np.arange(k)[None, :] % period[:, None]
    ok = np.broadcast_to(found[:, None], idx.shape)
    drafts = np.where(ok, tok[rows[:, None], np.minimum(idx, width - 1)], -1)
    return drafts, ok.sum(axis=1).astype(np.int64)


class _Index:
    """One sequence's n-grams: ``maps[n - min_n][ngram] = latest end position``, for every
    end position below ``upto``."""

    __slots__ = ("maps", "upto")

    def __init__(self, num_sizes: int) -> None:
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_sizes)]
        self.upto = 0


class NgramProposer:
    """The engine's n-gram proposer (``Proposer``): incremental, per sequence."""

    name = "ngram"

    def __init__(self, k: int, min_n: int = 2, max_n: int = 4) -> None:
        _check(k, min_n, max_n)
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._index: dict[int, _Index] = {}

    def _extend(self, index: _Index, tokens: Sequence[int], upto: int) -> None:
        """Indexes the n-grams ending at positions ``index.upto .. upto - 1``."""
        if upto <= index.upto:
            return
        lo = index.upto
        if upto - lo <= 8:  # the usual step: a few accepted tokens, a plain loop is fastest
            for end in range(lo, upto):
                for i, m in enumerate(index.maps):
                    n = self.min_n + i
                    if end >= n - 1:
                        m[tuple(tokens[end - n + 1 : end + 1])] = end
            index.upto = upto
            return
        for i, m in enumerate(index.maps):
            n = self.min_n + i
            first = max(lo, n - 1)  # the first end position with a whole n-gram
            if first >= upto:
                continue
            starts = first - n + 1
            grams = zip(*(tokens[starts + j : upto - n + 1 + j] for j in range(n)), strict=True)
            # later ends overwrite earlier ones
            m.update(zip(grams, range(first, upto), strict=True))
        index.upto = upto

    def _lookup(self, tokens: Sequence[int], k: int, index: _Index) -> list[int]:
        length = len(tokens)
        self._extend(index, tokens, length - 1)  # ends <= L - 2: a token follows each
        for i in range(len(index.maps) - 1, -1, -1):
            n = self.min_n + i
            if n > length - 1:
                continue
            end = index.maps[i].get(tuple(tokens[length - n :]))
            if end is not None:
                follow = tokens[end + 1 : end + 1 + k]
                while len(follow) < k:  # the match ends near the end: the pattern repeats
                    follow += follow[: k - len(follow)]
                return follow
        return []

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Drafts of each request (``Proposal`` with point masses: q is None)."""
        k_max = max((r.k for r in requests), default=1)
        out = Proposal.empty(len(requests), k_max)
        for row, r in enumerate(requests):
            index = self._index.get(r.seq_id)
            tokens = r.token_ids
            if index is None or index.upto > len(tokens):  # new, or not the same sequence
                index = self._index[r.seq_id] = _Index(self.max_n - self.min_n + 1)
            if not isinstance(tokens, list):
                tokens = list(tokens)
            drafts = self._lookup(tokens, min(r.k, self.k), index)
            out.tokens[row, : len(drafts)] = drafts
            out.num_tokens[row] = len(drafts)
        return out

    def release(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            self._index.pop(sid, None)

    def close(self) -> None:
        self._index.clear()
