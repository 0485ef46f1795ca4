"""Prefix caching: the same greedy tokens with and without it (shared prefixes of every
shape, chunked prefill, preemption, n > 1, a batch served from cache), salts that
isolate tenants, the hash chain, and property tests of the caching block manager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscale.server import LLM, SamplingParams
from kvscale.server.engine.block_hash import ROOT, block_hashes, hash_block
from kvscale.server.engine.block_manager import BlockError, BlockManager
from tests.hf_reference import random_prompts

BS = 8  # block size of the engine tests
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _shared_prefix_prompts() -> list[list[int]]:
    """Prompts sharing prefixes shorter than a block, exactly one block, several blocks plus
    a tail, and a whole prompt repeated."""
    base = random_prompts(1, (40, 40), seed=11)[0]
    tails = random_prompts(6, (3, 9), seed=12)
    return [
        base[:5] + tails[0][1:],  # shares 5 tokens: less than a block
        base[:5] + tails[1][1:],
        base[:BS] + tails[2][1:],  # exactly one block
        base[:BS] + tails[3][1:],
        base[:27] + tails[4][1:],  # three blocks and a tail
        base[:27] + tails[5][1:],
        base,  # the whole prompt, twice
        list(base),
        base[:16],  # a prompt that is exactly two cached blocks: its last token is recomputed
    ]


MODES: dict[str, dict[str, Any]] = {
    "default": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16, max_num_seqs=16),
    "preemption": dict(num_kv_blocks=16, max_model_len=96),
}


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Any]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def _all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(rc == 0 for rc in bm.ref_counts)
    assert bm.usage == 0.0 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_are_the_same_with_and_without_caching(llama_ckpt: Path, mode: str) -> None:
    prompts = _shared_prefix_prompts()
    kw = dict(device="cpu", block_size=BS, **MODES[mode])
    plain = LLM(str(llama_ckpt), enable_prefix_caching=False, **kw)
    cached = LLM(str(llama_ckpt), enable_prefix_caching=True, **kw)
    expected = _tokens(plain, prompts)
    assert _tokens(cached, prompts) == expected
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits > 0, stats
    _all_free(cached)
    if mode == "preemption":
        assert stats.num_preemptions > 0
    # the same batch again: every full prompt block but the last token's comes from cache
    hits_before = stats.prefix_cache_hits
    assert _tokens(cached, prompts) == expected
    again = cached.engine.stats()
    cacheable = sum((len(p) - 1) // BS * BS for p in prompts)
    assert again.prefix_cache_hits - hits_before == cacheable or mode == "preemption"
    _all_free(cached)
    assert cached.engine.block_manager.evictable_blocks  # cached, yet counted free


def test_n_samples_share_the_prompt_blocks(llama_ckpt: Path) -> None:
    prompt = random_prompts(1, (33, 33), seed=5)[0]
    params = SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=5, ignore_eos=True)
    plain = LLM(str(llama_ckpt), device="cpu", block_size=BS, enable_prefix_caching=False)
    cached = LLM(str(llama_ckpt), device="cpu", block_size=BS)
    assert _tokens(cached, [prompt], params) == _tokens(plain, [prompt], params)
    # three of the four samples found the prompt's four full blocks cached
    assert cached.engine.stats().prefix_cache_hits == 3 * 4 * BS
    _all_free(cached)


def test_different_salts_share_no_block_and_equal_salts_do(llama_ckpt: Path) -> None:
    llm = LLM(str(llama_ckpt), device="cpu", block_size=BS)
    eng = llm.engine
    prompt = random_prompts(1, (30, 30), seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=1)

    def run(rid: str, salt: str | None) -> int:
        before = eng.stats().prefix_cache_hits
        eng.add_request(rid, prompt, params, cache_salt=salt)
        while eng.has_unfinished_requests():
            eng.step()
        return eng.stats().prefix_cache_hits - before

    assert run("a", "tenant-a") == 0
    assert run("b", "tenant-b") == 0  # same prompt, other tenant: no hit
    assert run("c", None) == 0
    assert run("a2", "tenant-a") == 3 * BS  # same tenant: its three full blocks
    assert run("c2", None) == 3 * BS


def test_reset_forgets_the_cache(llama_ckpt: Path) -> None:
    llm = LLM(str(llama_ckpt), device="cpu", block_size=BS)
    prompt = random_prompts(1, (20, 20), seed=7)[0]
    llm.generate([prompt], GREEDY)
    # 20 prompt + 6 output tokens, 25 of them computed: three full blocks were cached
    assert llm.engine.reset_prefix_cache() == 3
    before = llm.engine.stats().prefix_cache_hits
    llm.generate([prompt], GREEDY)
    assert llm.engine.stats().prefix_cache_hits == before


# ---- the hash chain ---------------------------------------------------------------------------
def test_hashes_chain_whole_prefixes_and_stop_at_unknown_tokens() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2 and a[0] == hash_block(None, [1, 2, 3, 4])
    assert a[1] == hash_block(a[0], [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # another prefix, same block
    assert block_hashes([1, 2, 3, 4, 5, 6, -1, 8], 4) == a[:1]  # a placeholder stops it
    assert block_hashes([1, 2, 3, 4], 4, salt="x") != a[:1]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, start=a[:1]) == a
    assert len(ROOT) == 32 and all(len(h) == 32 for h in a)


# ---- property tests of the caching block manager -------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "append", "free", "preempt", "reset"]),
        st.integers(0, 5),  # which sequence
        st.integers(0, 3),  # which prompt family
        st.integers(1, 30),  # tokens
    ),
    max_size=60,
)


@settings(max_examples=250, deadline=None)
@given(num_blocks=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4]), ops=OPS)
def test_caching_block_manager_keeps_its_invariants(
    num_blocks: int, block_size: int, ops: list
) -> None:
    bm = BlockManager(num_blocks, block_size, enable_caching=True)
    tables: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {}
    freed_order: list[int] = []
    for op, key, family, n in ops:
        table = tables.setdefault(key, [])
        if op == "admit" and not table:
            toks = [family] * n  # same family -> same content -> shared prefix
            hashes = block_hashes(toks, block_size)
            hits = bm.match(hashes[: (len(toks) - 1) // block_size])
            if bm.can_allocate(table, len(toks), hits):
                bm.allocate(table, len(toks), hits)
                assert table[: len(hits)] == hits
                bm.commit(table, hashes, len(hits))
                tokens[key] = toks
            else:
                with pytest.raises(BlockError):
                    bm.allocate(table, len(toks), hits)
        elif op == "append" and table:
            toks = tokens[key] + [family]
            if bm.can_allocate(table, len(toks)):
                bm.allocate(table, len(toks))
                tokens[key] = toks
                bm.commit(table, block_hashes(toks, block_size), 0)
        elif op in ("free", "preempt") and table:
            freed_order.extend(b for b in reversed(table) if bm.ref_counts[b] == 1)
            bm.free(table)
        elif op == "reset":
            bm.reset_cache()
        _check(bm, tables, tokens, block_size)
    for table in tables.values():
        bm.free(table)
    assert bm.num_free_blocks == num_blocks and bm.usage == 0.0


def _check(
    bm: BlockManager, tables: dict[int, list[int]], tokens: dict[int, list[int]], bs: int
) -> None:
    # reference counts, free lists (a free block is evictable exactly when it still holds
    # a cached hash), the cache index and the per-block hashes agreeing
    bm.check(list(tables.values()))
    free = bm.free_blocks
    # a cached block in use holds the content its hash names
    for key, table in tables.items():
        if not table:
            continue
        expected = block_hashes(tokens[key], bs)
        for i, b in enumerate(table):
            if bm.block_hash[b] is not None and i < len(expected):
                assert bm.block_hash[b] == expected[i]
    assert bm.usage == pytest.approx(1 - len(free) / bm.num_blocks)


def test_evictable_blocks_go_least_recently_freed_first_tail_first() -> None:
    bm = BlockManager(6, 2, enable_caching=True)
    a: list[int] = []
    toks = [7] * 6
    bm.allocate(a, 6)
    bm.commit(a, block_hashes(toks, 2), 0)
    first, second, third = a
    bm.free(a)
    assert bm.evictable_blocks == [third, second, first]  # the tail goes first
    b: list[int] = []
    bm.allocate(b, 2 * 4)  # 3 plain blocks, then one eviction: the tail block
    assert bm.num_evictions == 1 and third in b
    assert bm.match(block_hashes(toks, 2)) == [first, second]
