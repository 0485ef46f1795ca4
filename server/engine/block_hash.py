"""Content hashes of full KV blocks, chained from the first block: the prefix cache's keys.

A block's hash is SHA-256 over a canonical encoding of its parent's hash (the root for
the first block), its token ids (int64, little-endian, length-prefixed) and extra keys
(the request's ``cache_salt``, later adapter ids; only the first block carries them, and
the chain carries them on). Two blocks share a hash only if their whole prefix, token for
token, and their salt are equal.

Why SHA-256: a cache hit reuses another request's K/V without comparing token ids, so a
collision would silently give one request another's context (vLLM moved to SHA-256 after
its collision advisory, GHSA-rm76-4mrf-v9r8, for this reason). At about 100-200 ns per
token it costs little next to a prefill. Pure Python, no torch: a router can compute the
same hashes from token ids.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 32 bytes

ROOT = hashlib.sha256(b"kvscale prefix cache v1").digest()


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockHash:
    """The hash of one full block: ``parent`` (None for the first block), its
    ``token_ids`` and, for the first block, ``salt``."""
    h = hashlib.sha256(parent if parent is not None else ROOT)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    if salt is not None:
        data = salt.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(data)) + data)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    start: Sequence[BlockHash] = (),
    num_tokens: int | None = None,
) -> list[BlockHash]:
    """The hashes of every full block of ``token_ids[:num_tokens]`` (default: all),
    continuing ``start`` (hashes of the first ``len(start)`` blocks, already known). Stops
    before the first block that holds a negative id (a token still being sampled)."""
    out = list(start)
    parent = out[-1] if out else None
    end = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    for b in range(len(out), end // block_size):
        block = token_ids[b * block_size : (b + 1) * block_size]
        if min(block) < 0:
            break
        parent = hash_block(parent, block, salt if b == 0 else None)
        out.append(parent)
    return out
