"""Property tests of the block manager: no leak, no double free, consistent ref counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscale.server.engine.block_manager import BlockError, BlockManager

OPS = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "append", "share", "free", "preempt"]),
        st.integers(0, 7),  # which table
        st.integers(1, 40),  # tokens
    ),
    max_size=80,
)


def _check(bm: BlockManager, tables: dict[int, list[int]]) -> None:
    bm.check(list(tables.values()))  # reference counts, free lists, cache maps
    assert 0.0 <= bm.usage <= 1.0


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), ops=OPS)
def test_random_operations_keep_invariants(num_blocks: int, block_size: int, ops: list) -> None:
    bm = BlockManager(num_blocks, block_size)
    tables: dict[int, list[int]] = {}
    lengths: dict[int, int] = {}
    for op, key, tokens in ops:
        table = tables.setdefault(key, [])
        if op in ("allocate", "append"):
            target = lengths.get(key, 0) + (tokens if op == "allocate" else 1)
            if bm.can_allocate(table, target):
                bm.allocate(table, target)
                lengths[key] = target
                assert len(table) == bm.blocks_for(target)
            else:
                with pytest.raises(BlockError):
                    bm.allocate(table, target)
        elif op == "share" and table:
            new_key = max(tables) + 1
            tables[new_key] = bm.share(table)
            lengths[new_key] = len(table) * block_size
        elif op == "free":
            bm.free(table)
            lengths[key] = 0
        elif op == "preempt":  # freed, then re-admitted: its blocks are allocated anew
            length = lengths.get(key, 0)
            bm.free(table)
            assert table == []
            lengths[key] = 0
            if length and bm.can_allocate(table, length):
                bm.allocate(table, length)
                lengths[key] = length
        _check(bm, tables)
    for table in tables.values():
        bm.free(table)
    assert bm.num_free_blocks == num_blocks
    assert all(rc == 0 for rc in bm.ref_counts)


def test_double_free_is_caught() -> None:
    bm = BlockManager(4, 16)
    table: list[int] = []
    bm.allocate(table, 20)
    copy = list(table)
    bm.free(table)
    with pytest.raises(BlockError, match="double free"):
        bm.free(copy)


def test_shared_blocks_return_once_all_holders_free() -> None:
    bm = BlockManager(4, 16)
    a: list[int] = []
    bm.allocate(a, 32)
    b = bm.share(a)
    bm.free(a)
    assert bm.num_free_blocks == 2
    bm.free(b)
    assert bm.num_free_blocks == 4


def test_usage_fraction() -> None:
    bm = BlockManager(10, 16)
    t: list[int] = []
    bm.allocate(t, 16 * 3)
    assert bm.usage == pytest.approx(0.3)
