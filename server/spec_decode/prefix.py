"""The longest common prefix of two token lists, fast when most of it is known to agree."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def as_token_list(tokens: Sequence[int] | np.ndarray) -> list[int]:
    """``tokens`` as a list of Python ints (no copy if it already is a list)."""
    if isinstance(tokens, list):
        return tokens
    if isinstance(tokens, np.ndarray):
        return tokens.tolist()
    return list(tokens)


def common_prefix_len(a: list[int], b: list[int], hint: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``.

    ``hint``: a length up to which they usually agree (a proposer's accepted tokens, before
    its drafts); checked with one C-speed slice comparison, then the rest is scanned one
    token at a time (a few drafts). Falls back to numpy when the hint is wrong."""
    n = min(len(a), len(b))
    h = min(hint, n)
    if a[:h] != b[:h]:
        x = np.asarray(a[:h], dtype=np.int64)
        y = np.asarray(b[:h], dtype=np.int64)
        return int(np.argmax(x != y))
    i = h
    while i < n and a[i] == b[i]:
        i += 1
    return i


def held_prefix_len(held: list[int], tokens: list[int], base: int) -> int:
    """How many leading tokens of ``held`` (what a proposer holds for a sequence: the
    caller's accepted tokens up to ``base``, then its own drafts) agree with ``tokens``
    (the caller's accepted tokens now). Accepted tokens are final (the ``Proposer``
    contract), so the first ``base`` agree unless the sequence was replaced, which its
    last one is checked for (then everything is compared): the cost is that of the
    drafts, not of the sequence. A contract broken further back costs acceptance only:
    verification is exact whatever is drafted."""
    n = min(len(held), len(tokens))
    h = min(base, n)
    if h and held[h - 1] != tokens[h - 1]:
        return common_prefix_len(held, tokens)
    i = h
    while i < n and held[i] == tokens[i]:
        i += 1
    return i
