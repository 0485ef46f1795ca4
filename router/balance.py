"""Replica choice, as pure functions: the routing key of a prompt, the hash ring, and
consistent hashing with bounded loads (CHWBL, as KubeAI's PrefixHash balancer).

Every router replica computes the same choice from the same inputs: ring positions come
from SHA-256 of the replica's address (never Python's salted ``hash()``), and the key is
the engine's own prefix-cache block hash, so requests that share the first blocks of
their prompt share a key exactly when the engine could reuse those blocks.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvscale.server.engine.block_hash import BlockHash, block_hashes

DEFAULT_VNODES = 100  # ring points per replica (KubeAI's "replication", default 256)
DEFAULT_EPSILON = 0.25  # a replica may carry up to (1 + epsilon) x the mean load
DEFAULT_KV_THRESHOLD = 0.95  # a replica whose KV cache is fuller than this is "over bound"

# Why a request went where it went (the metric's ``reason`` label).
PREFIX_HIT = "prefix_hit"  # the prefix's home replica on the ring
LOAD_BOUND = "load_bound_exceeded"  # the home was over its bound: the next one on the ring
NO_PREFIX = "no_prefix"  # shorter than one block: the least-loaded replica
LEAST_LOADED = "least_loaded"  # --policy least-loaded
RANDOM = "random"  # --policy random


def stable_hash(data: str | bytes) -> int:
    """A 64-bit position, the same in every process (SHA-256's first 8 bytes)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big")


def prefix_key(
    token_ids: Sequence[int], block_size: int, max_blocks: int, salt: str | None = None
) -> BlockHash | None:
    """The routing key of a prompt: the engine's chained block hash of its first
    ``min(full blocks, max_blocks)`` blocks (the salt, as the engine's, in the first);
    None when the prompt is shorter than one block (nothing a cache could reuse)."""
    if block_size < 1 or max_blocks < 1:
        raise ValueError("block_size and max_blocks must be >= 1")
    n = min(len(token_ids), block_size * max_blocks)
    hashes = block_hashes(token_ids, block_size, salt, num_tokens=n)
    return hashes[-1] if hashes else None


class HashRing:
    """``vnodes`` points per replica on a 64-bit ring; ``walk(key)`` yields every replica
    once, in ring order from the key's position (the first one is the key's home)."""

    def __init__(self, replicas: Sequence[str], vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.replicas = sorted(set(replicas))
        points = [(stable_hash(f"{r}#{i}"), r) for r in self.replicas for i in range(vnodes)]
        points.sort()
        self._pos = [p for p, _ in points]
        self._owner = [r for _, r in points]

    def walk(self, key: bytes) -> Iterator[str]:
        if not self._pos:
            return
        start = bisect.bisect_left(self._pos, stable_hash(key))
        seen: set[str] = set()
        n = len(self._pos)
        for i in range(n):
            r = self._owner[(start + i) % n]
            if r not in seen:
                seen.add(r)
                yield r
                if len(seen) == len(self.replicas):
                    return


@dataclass(frozen=True)
class Load:
    """A replica's load as the router sees it: the requests this router has in flight
    there (current), plus the requests the replica last reported running or waiting
    beyond those (``others``: other routers' requests; up to one scrape old), and the
    fraction of its KV cache in use. Counting the reported number whole would count this
    router's requests twice, and stale: a replica that just finished would look busy."""

    inflight: int = 0
    others: int = 0
    kv_usage: float = 0.0

    @property
    def total(self) -> int:
        return self.inflight + self.others


def load_bound(loads: dict[str, Load], epsilon: float) -> int:
    """CHWBL's capacity: ceil((1 + epsilon) x the mean load counting the new request).
    The least-loaded replica always fits it (min + 1 <= ceil((total + 1) / n))."""
    total = sum(x.total for x in loads.values())
    return math.ceil((1 + epsilon) * (total + 1) / max(1, len(loads)))


def fits(load: Load, bound: int, kv_threshold: float) -> bool:
    """Whether one more request keeps the replica within its bound."""
    return load.total + 1 <= bound and load.kv_usage < kv_threshold


def least_loaded(loads: dict[str, Load], exclude: frozenset[str] = frozenset()) -> str | None:
    """The replica with the least load (ties: the smaller address hash, so that every
    router breaks them alike); replicas over the KV threshold last."""
    cands = [r for r in loads if r not in exclude]
    if not cands:
        return None
    return min(cands, key=lambda r: (loads[r].total, loads[r].kv_usage, stable_hash(r)))


@dataclass(frozen=True)
class Choice:
    replica: str
    reason: str
    bound: int  # the load bound at the time of the choice
    load: int  # the chosen replica's load before this request


def choose(
    policy: str,
    key: bytes | None,
    ring: HashRing,
    loads: dict[str, Load],
    *,
    epsilon: float = DEFAULT_EPSILON,
    kv_threshold: float = DEFAULT_KV_THRESHOLD,
    exclude: frozenset[str] = frozenset(),
    rng: random.Random | None = None,
) -> Choice | None:
    """The replica for one request among ``loads`` (the ready ones) minus ``exclude``
    (already tried); None if none is left.

    ``prefix``: walk the ring from the key; take the first replica that fits the bound
    (its home: ``prefix_hit``; a later one: ``load_bound_exceeded``); if none fits (every
    one is over the KV threshold), the least loaded. Without a key: the least loaded
    (``no_prefix``). ``least-loaded`` and ``random`` ignore the key.
    """
    avail = {r: x for r, x in loads.items() if r not in exclude}
    if not avail:
        return None
    bound = load_bound(loads, epsilon)

    def pick(r: str, reason: str) -> Choice:
        return Choice(r, reason, bound, avail[r].total)

    if policy == "random":
        return pick((rng or random).choice(sorted(avail)), RANDOM)
    if policy == "least-loaded":
        return pick(least_loaded(avail), LEAST_LOADED)  # type: ignore[arg-type]
    if policy != "prefix":
        raise ValueError(f"unknown policy {policy!r}")
    if key is None:
        return pick(least_loaded(avail), NO_PREFIX)  # type: ignore[arg-type]
    home = True
    for r in ring.walk(key):
        if r not in loads:  # not ready: not a candidate, and not the home either
            continue
        if r in avail and fits(avail[r], bound, kv_threshold):
            return pick(r, PREFIX_HIT if home else LOAD_BOUND)
        home = False
    return pick(least_loaded(avail), LOAD_BOUND)  # type: ignore[arg-type]
