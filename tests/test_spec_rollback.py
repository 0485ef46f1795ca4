"""KV rollback for speculative decoding at the block-manager level: a randomized run of
verify steps (allocate for the last token plus k drafts, keep the accepted prefix, truncate
the rest) with prefix caching, sharing, preemption and finishing; the pool's invariants
hold after every step and the cache only ever names accepted tokens."""

from __future__ import annotations

import random

import pytest

from kvscale.server.engine.block_hash import block_hashes
from kvscale.server.engine.block_manager import BlockError, BlockManager

BS = 4


def test_truncate_drops_the_tail_blocks():
    bm = BlockManager(8, BS)
    table: list[int] = []
    bm.allocate(table, 10)  # 3 blocks
    assert bm.truncate(table, 9) == 0 and len(table) == 3
    assert bm.truncate(table, 8) == 1 and len(table) == 2
    assert bm.truncate(table, 0) == 2 and table == []
    bm.check([table])
    assert bm.num_free_blocks == 8


def test_check_finds_a_leak_and_a_double_count():
    bm = BlockManager(4, BS)
    a: list[int] = []
    bm.allocate(a, 8)
    bm.check([a])
    with pytest.raises(BlockError):
        bm.check([])  # a's blocks are leaked if no table holds them
    with pytest.raises(BlockError):
        bm.check([a, a])  # or double-counted


class _Seq:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # accepted tokens (prompt + output)
        self.table: list[int] = []
        self.computed = 0  # tokens whose K/V is in the table
        self.committed = 0  # blocks registered in the prefix cache


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_randomized_verify_steps_keep_invariants(caching: bool, seed: int):
    rng = random.Random(seed)
    bm = BlockManager(16, BS, enable_caching=caching)
    live: list[_Seq] = []
    waiting: list[_Seq] = []
    shared_prefix = [rng.randrange(5) for _ in range(9)]
    accepted_hashes: set = set()
    dropped = preempted = 0

    def commit(s: _Seq) -> None:
        if not caching:
            return
        hashes = block_hashes(s.tokens, BS, None, (), s.computed)
        accepted_hashes.update(hashes)
        if len(hashes) > s.committed:
            bm.commit(s.table, hashes, s.committed)
            s.committed = len(hashes)

    for _ in range(300):
        if rng.random() < 0.3 or not live:
            waiting.append(_Seq([*shared_prefix[: rng.randrange(10)], rng.randrange(5)]))
        # admit (prefill the whole sequence but its last token, from cache hits first)
        while waiting:
            s = waiting[0]
            hits: list[int] = []
            if caching:
                limit = (len(s.tokens) - 1) // BS
                hits = bm.match(block_hashes(s.tokens, BS)[:limit])
            if not bm.can_allocate(s.table, len(s.tokens) - 1, hits):
                break
            bm.allocate(s.table, len(s.tokens) - 1, hits)
            s.computed = len(s.tokens) - 1
            s.committed = len(hits)
            commit(s)
            live.append(waiting.pop(0))
        # a verify step: each live sequence feeds its last token plus k drafts
        for s in list(live):
            if s not in live:
                continue  # preempted by an earlier sequence of this step
            k = rng.randrange(0, 5)
            while not bm.can_allocate(s.table, len(s.tokens) + k):
                victim = live.pop()
                preempted += 1
                bm.free(victim.table)
                victim.computed = victim.committed = 0
                waiting.insert(0, victim)
                if victim is s:
                    break
            if s not in live:
                continue
            bm.allocate(s.table, len(s.tokens) + k)
            drafts = [rng.randrange(5) for _ in range(k)]
            a = rng.randrange(0, k + 1)
            fed = len(s.tokens)
            s.tokens += [*drafts[:a], rng.randrange(5)]  # accepted drafts + the target token
            s.computed = fed + a  # K/V of the last token and the accepted drafts
            dropped += bm.truncate(s.table, s.computed)
            commit(s)
            assert len(s.table) == bm.blocks_for(s.computed)
        # finish some
        for s in list(live):
            if rng.random() < 0.1 or len(s.tokens) > 40:
                live.remove(s)
                bm.free(s.table)
        bm.check([s.table for s in live] + [s.table for s in waiting])
        assert set(bm.cached) <= accepted_hashes
    for s in live:
        bm.free(s.table)
    bm.check([])
    assert bm.num_free_blocks == bm.num_blocks
    assert dropped > 0 and preempted > 0, (dropped, preempted)
