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
