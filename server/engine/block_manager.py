"""The KV-cache block pool: reference counts, a free list, and the prefix cache.

Blocks hold ``block_size`` tokens of K/V in every layer. A sequence owns a block table
(list of block ids); a block can be in several tables (its reference count is the number
of tables holding it).

Prefix caching (``enable_caching``): a full block whose tokens are final can be
registered under its content hash (``block_hash``: chained from the first block, so the
hash names the whole prefix). ``match`` maps a prompt's leading block hashes to cached
blocks, which ``allocate`` then puts at the start of the new table. A block whose count
drops to zero keeps its hash and becomes *evictable*: free, but still a cache hit until
it is needed. Free blocks are taken plain ones first, then evictable ones least recently
freed first (``free`` releases a table tail-first, so a prompt's end goes before its
start). Evictable blocks count as free everywhere (``num_free_blocks``, ``usage``):
they hold no live sequence's state.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from kvscale.server.engine.block_hash import BlockHash


class BlockError(RuntimeError):
    """An internal invariant was broken (double free, over-allocation)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # hash -> the block holding that content
        self._plain: deque[int] = deque(range(num_blocks))  # free, caching nothing
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; LRU first
        self.num_evictions = 0

    # ---- counts ------------------------------------------------------------------------
    @property
    def free_blocks(self) -> list[int]:
        """Every free block: plain ones, then evictable ones in eviction order."""
        return [*self._plain, *self._evictable]

    @property
    def evictable_blocks(self) -> list[int]:
        """Free blocks still cached, least recently freed first."""
        return list(self._evictable)

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences, 0..1 (cached free blocks are free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to ``block_table`` so it holds ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    # ---- the prefix cache ----------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (no reference taken)."""
        hits = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def commit(self, block_table: list[int], hashes: Sequence[BlockHash], start: int) -> None:
        """Registers ``block_table[i]`` under ``hashes[i]`` for ``i >= start`` (full blocks
        whose K/V is computed or being computed by a step already launched or about to
        be). A hash already cached elsewhere keeps its block; this one stays plain."""
        if not self.enable_caching:
            return
        for i in range(start, len(hashes)):
            block, h = block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block

    def reset_cache(self) -> int:
        """Forgets every cached hash (blocks in use keep their contents); returns how many
        were dropped."""
        n = len(self.cached)
        for block in self.cached.values():
            self.block_hash[block] = None
        self.cached.clear()
        self._plain.extend(self._evictable)
        self._evictable.clear()
        return n

    # ---- allocation -------------------------------------------------------------------
    def can_allocate(
        self, block_table: list[int], num_tokens: int, hits: Sequence[int] = ()
    ) -> bool:
        """Whether ``allocate(block_table, num_tokens, hits)`` would succeed."""
        need = self.num_new_blocks(block_table, num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        return need <= self.num_free_blocks - revived

    def allocate(self, block_table: list[int], num_tokens: int, hits: Sequence[int] = ()) -> None:
        """Grows ``block_table`` in place to cover ``num_tokens`` tokens: first the cached
        ``hits`` (from ``match``; only into an empty table), then free blocks."""
        if hits and block_table:
            raise BlockError("cache hits go at the start of an empty block table")
        if not self.can_allocate(block_table, num_tokens, hits):
            need = self.num_new_blocks(block_table, num_tokens)
            raise BlockError(f"asked for {need} blocks, {self.num_free_blocks} free")
        for block in hits:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1
            block_table.append(block)
        for _ in range(self.num_new_blocks(block_table, num_tokens)):
            block = self._take_free()
            self.ref_counts[block] = 1
            block_table.append(block)

    def _take_free(self) -> int:
        if self._plain:
            block = self._plain.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                del self.cached[h]
                self.block_hash[block] = None
            self.num_evictions += 1
        if self.ref_counts[block] != 0:
            raise BlockError(f"free block {block} has refcount {self.ref_counts[block]}")
        return block

    def share(self, block_ids: list[int]) -> list[int]:
        """Returns a new table holding the same blocks (each reference count + 1)."""
        for block in block_ids:
            if self.ref_counts[block] <= 0:
                raise BlockError(f"cannot share block {block}: it is free")
            self.ref_counts[block] += 1
        return list(block_ids)

    def free(self, block_table: list[int]) -> None:
        """Drops this table's references (last block first) and empties the table."""
        self._release(block_table, 0)

    def truncate(self, block_table: list[int], num_tokens: int) -> int:
        """Shrinks ``block_table`` in place to the blocks covering its first ``num_tokens``
        tokens, dropping the references of the rest (last block first); returns how many
        blocks it dropped. Speculative decoding's rollback of rejected positions: the kept
        blocks' K/V beyond ``num_tokens`` is stale and is overwritten when those positions
        are computed again."""
        keep = self.blocks_for(max(num_tokens, 0))
        dropped = max(0, len(block_table) - keep)
        self._release(block_table, keep)
        return dropped

    def _release(self, block_table: list[int], keep: int) -> None:
        for block in reversed(block_table[keep:]):
            if self.ref_counts[block] <= 0:
                raise BlockError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._plain.append(block)
        del block_table[keep:]

    def check(self, tables: Sequence[Sequence[int]]) -> None:
        """Raises BlockError unless the pool is consistent with the live ``tables``: every
        block's reference count is the number of times the tables hold it, the free lists
        hold exactly the blocks with count zero (once each) and the cache maps agree."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block in table:
                counts[block] += 1
        if counts != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if counts[b] != self.ref_counts[b]]
            raise BlockError(f"reference counts disagree with the tables at blocks {bad[:8]}")
        free = self.free_blocks
        if len(free) != len(set(free)) or set(self._plain) & set(self._evictable):
            raise BlockError("a block is on the free lists twice")
        if sorted(free) != [b for b in range(self.num_blocks) if counts[b] == 0]:
            raise BlockError("free lists disagree with the reference counts")
        if any(self.block_hash[b] is not None for b in self._plain):
            raise BlockError("a plain free block still has a hash")
        if any(self.block_hash[b] is None for b in self._evictable):
            raise BlockError("an evictable block has no hash")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise BlockError(f"cache entry of block {b} disagrees with its hash")
        if sum(h is not None for h in self.block_hash) != len(self.cached):
            raise BlockError("a hashed block is not in the cache map")
