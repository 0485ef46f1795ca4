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
- ``NgramProposer`` (the engine's ``Proposer``): one dict from every sequence's n-grams
  (64-bit hashes salted per sequence) to their latest end positions, extended each call
  with the n-grams of the tokens accepted since the last one (the engine's token lists
  only grow), hashed for the whole batch at once. A proposal is then ``max_n - min_n + 1``
  dict lookups, so its cost does not grow with the sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from operator import getitem

import numpy as np

from kvscale.server.spec_decode.proposer import DraftRequest, Proposal


def check_ngram_settings(k: int, min_n: int, max_n: int) -> None:
    """ValueError unless ``k >= 1`` and ``1 <= min_n <= max_n`` (both n-gram proposers)."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens={k}: must be >= 1")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"prompt_lookup_min={min_n}, max={max_n}: need 1 <= min <= max")


def ngram_lookup(
    sequences: Sequence[Sequence[int] | np.ndarray], k: int, min_n: int = 1, max_n: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Returns ``(drafts [B, k] int64, padded with -1; num_drafts [B] int64)``."""
    check_ngram_settings(k, min_n, max_n)
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


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_POLY = np.uint64(0x100000001B3)  # odd: the n-gram polynomial's base


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def ngram_keys(tokens: np.ndarray, salts: np.ndarray, sizes: range) -> np.ndarray:
    """uint64 ``[len(sizes), T]``: the keys of the ``n``-grams (``n`` in ``sizes``) ending
    at each position of ``tokens`` (int64 ``[T]``), salted by ``salts`` (uint64 ``[T]``,
    one value per sequence): distinct for different n-grams, sizes or salts up to 64-bit
    hash collisions. A position's key is meaningful only with ``n - 1`` tokens of its
    sequence before it."""
    keys = np.empty((len(sizes), len(tokens)), dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = _mix(tokens.astype(np.uint64) + _GOLDEN)
        h = mixed.copy()  # the 1-grams' polynomial
        for n in range(1, sizes.stop):
            if n > 1:  # h_n[p] = h_{n-1}[p-1] * POLY + token p
                h = np.concatenate((mixed[:1], h[:-1] * _POLY + mixed[1:]))
            if n >= sizes.start:
                keys[n - sizes.start] = _mix(h ^ (salts + np.uint64(n) * _GOLDEN))
    return keys


class NgramProposer:
    """The engine's n-gram proposer (``Proposer``): incremental and batched.

    One dict maps the 64-bit key of every n-gram of every sequence (``ngram_keys``,
    salted per sequence) to the n-gram's latest end position. Each call hashes only the
    n-grams ending at the tokens accepted since the last call, for the whole batch at
    once (numpy), inserts them with one ``dict.update`` and looks up every suffix with
    one ``map``: the Python left per sequence is a slice of its new tokens and, where a
    match is found, of the drafts. ``release`` recomputes a sequence's keys to delete
    them. A key collision (~T / 2**64 a lookup) can only make a wrong draft, which
    verification rejects."""

    name = "ngram"

    def __init__(self, k: int, min_n: int = 2, max_n: int = 4) -> None:
        check_ngram_settings(k, min_n, max_n)
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._sizes = range(min_n, max_n + 1)
        # [S, 1]: tokens an n-gram of each size needs before its end (n - 1)
        self._before = np.arange(min_n - 1, max_n)[:, None]
        self._ends: dict[int, int] = {}  # n-gram key -> latest end position
        # seq_id -> (salt, ends indexed: 0 .. upto - 1, the tokens last seen)
        self._seqs: dict[int, tuple[int, int, Sequence[int]]] = {}
        self._salts_made = 0

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        """Drafts of each request (``Proposal`` with point masses: q is None)."""
        b = len(requests)
        k_max = max((r.k for r in requests), default=1)
        out = Proposal.empty(b, k_max)
        if b == 0:
            return out
        ids = [r.seq_id for r in requests]
        toks = [r.token_ids for r in requests]
        if not all(type(t) is list for t in toks):
            toks = [t if type(t) is list else list(t) for t in toks]
        length = np.fromiter(map(len, toks), dtype=np.int64, count=b)
        held = list(map(self._seqs.get, ids))
        upto = np.fromiter((-1 if h is None else h[1] for h in held), np.int64, count=b)
        salt = np.fromiter((0 if h is None else h[0] for h in held), np.uint64, count=b)
        for row in np.flatnonzero((upto < 0) | (upto > length - 1)).tolist():
            self._forget(ids[row])  # new, or not the same sequence: start over
            self._salts_made += 1
            salt[row] = _mix(np.array([self._salts_made], dtype=np.uint64))[0]
            upto[row] = 0
        held_now = zip(salt.tolist(), np.maximum(length - 1, 0).tolist(), toks, strict=True)
        self._seqs.update(zip(ids, held_now, strict=True))
        # Each sequence's window: from max_n - 1 tokens before its first unindexed end
        # to its last token (the new ends' n-grams and the suffix to look up).
        lo = np.maximum(upto - (self.max_n - 1), 0)
        size = length - lo
        flat = np.fromiter(
            chain.from_iterable(map(getitem, toks, map(slice, lo.tolist(), repeat(None)))),
            dtype=np.int64,
            count=int(size.sum()),
        )
        seg = np.repeat(np.arange(b), size)
        starts = np.cumsum(size) - size
        pos = np.arange(len(flat)) - starts[seg] + lo[seg]  # each token's position
        keys = ngram_keys(flat, np.repeat(salt, size), self._sizes)  # [S, T]
        # index the ends upto .. length - 2 (a token follows each), with n - 1 before;
        # a key's later ends come later in the update, so the latest one stays
        new = (pos >= upto[seg]) & (pos <= length[seg] - 2)
        take = new[None, :] & ((pos - lo[seg])[None, :] >= self._before)
        ends = self._ends
        ends.update(
            zip(keys[take].tolist(), np.broadcast_to(pos, take.shape)[take].tolist(), strict=True)
        )
        # look up each sequence's suffixes, longest first
        last = starts + size - 1
        found = np.full(b, -1, dtype=np.int64)
        for i in range(len(self._sizes) - 1, -1, -1):
            rows = np.flatnonzero((found < 0) & (length >= self.min_n + i + 1))
            if len(rows):
                asked = keys[i, last[rows]].tolist()
                found[rows] = list(map(ends.get, asked, repeat(-1)))
        for row in np.flatnonzero(found >= 0).tolist():
            r = requests[row]
            tokens = toks[row]
            end = int(found[row])
            k = min(r.k, self.k)
            follow = tokens[end + 1 : end + 1 + k]
            while len(follow) < k:  # the match ends near the end: the pattern repeats
                follow += follow[: k - len(follow)]
            out.tokens[row, :k] = follow
            out.num_tokens[row] = k
        return out

    def _forget(self, seq_id: int) -> None:
        """Deletes a sequence's n-grams (their keys, recomputed from its tokens)."""
        held = self._seqs.pop(seq_id, None)
        if held is None:
            return
        salt, upto, tokens = held
        upto = min(upto, len(tokens))
        if upto <= 0:
            return
        toks = np.asarray(tokens[:upto], dtype=np.int64)
        keys = ngram_keys(toks, np.full(upto, salt, dtype=np.uint64), self._sizes)
        fits = np.arange(upto)[None, :] >= self._before
        deque(map(self._ends.pop, keys[fits].tolist(), repeat(None)), 0)

    def release(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            self._forget(sid)

    def close(self) -> None:
        self._ends.clear()
        self._seqs.clear()
