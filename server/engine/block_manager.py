"""The KV-cache block pool: a free list and per-block reference counts.

Blocks hold ``block_size`` tokens of K/V in every layer. A sequence owns a block
table (list of block ids); a block can be shared by several tables (its reference
count is the number of tables holding it), which prefix caching builds on. A block
returns to the free list when its count drops to zero.
"""

from __future__ import annotations

from collections import deque


class BlockError(RuntimeError):
    """An internal invariant was broken (double free, over-allocation)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, block_table: list[int], num_tokens: int) -> int:
        """Blocks to add to ``block_table`` so it holds ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_table, num_tokens) <= self.num_free_blocks

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grows ``block_table`` in place to cover ``num_tokens`` tokens."""
        need = self.num_new_blocks(block_table, num_tokens)
        if need > self.num_free_blocks:
            raise BlockError(f"asked for {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            block = self.free_blocks.popleft()
            if self.ref_counts[block] != 0:
                raise BlockError(
                    f"block {block} on the free list has refcount {self.ref_counts[block]}"
                )
            self.ref_counts[block] = 1
            block_table.append(block)

    def share(self, block_ids: list[int]) -> list[int]:
        """Returns a new table holding the same blocks (each reference count + 1)."""
        for block in block_ids:
            if self.ref_counts[block] <= 0:
                raise BlockError(f"cannot share block {block}: it is free")
            self.ref_counts[block] += 1
        return list(block_ids)

    def free(self, block_table: list[int]) -> None:
        """Drops this table's references (last block first) and empties the table."""
        for block in reversed(block_table):
            if self.ref_counts[block] <= 0:
                raise BlockError(f"double free of block {block}")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        block_table.clear()
