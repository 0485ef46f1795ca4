"""Greedy outputs token-identical to transformers' generate, across architectures and
under forced chunked prefill and forced preemption; every block freed at the end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvscale.server import LLM, SamplingParams
from tests.conftest import LLAMA3_SCALING
from tests.hf_reference import hf_greedy, random_prompts

MAX_NEW = 12
PROMPTS = random_prompts(16, (2, 70), seed=1)

ARCHES: dict[str, dict] = {
    "llama": dict(arch="llama"),
    "llama3-rope-scaling-sharded": dict(
        arch="llama", rope_scaling=LLAMA3_SCALING, max_shard_size="3MB", seed=3
    ),
    "mistral": dict(arch="mistral", seed=1),
    "qwen2": dict(arch="qwen2", seed=2),
}

MODES: dict[str, dict] = {
    "default": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=16, max_num_seqs=16),
    "preemption": dict(num_kv_blocks=14, max_model_len=96, block_size=8),
}


@pytest.fixture(scope="module")
def references(checkpoint_factory: Callable[..., Path]) -> dict[str, tuple[Path, list]]:
    refs = {}
    for name, kwargs in ARCHES.items():
        path = checkpoint_factory(name, **kwargs)
        refs[name] = (path, hf_greedy(path, PROMPTS, MAX_NEW))
    return refs


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", list(ARCHES))
def test_greedy_matches_transformers(references: dict, arch: str, mode: str) -> None:
    path, expected = references[arch]
    llm = LLM(str(path), device="cpu", **MODES[mode])
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert not mismatches, (
        f"prompts {mismatches} differ: {got[mismatches[0]]} vs {expected[mismatches[0]]}"
    )
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert all(rc == 0 for rc in eng.block_manager.ref_counts)
    assert not eng.has_unfinished_requests()
    if mode == "preemption":
        assert eng.stats().num_preemptions > 0
    if mode == "chunked-prefill":
        assert max(len(p) for p in PROMPTS) > 16  # some prompts really were split
