"""The decode graphs' L2 prefetch on CUDA (GPU machine only): it changes no bit of what
the engine computes (greedy tokens and their logprobs equal with it off), at batch
sizes that fetch (up to ``MAX_ROWS``) and past them."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.layers import l2_prefetch
from tests.hf_reference import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = random_prompts(16, (2, 90), seed=3)
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


def _outputs(path: Path, on: bool, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple]]:
    monkeypatch.setenv("KVSCALE_L2_PREFETCH", "1" if on else "0")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=256,
              cuda_graph_max_batch=16)
    try:
        graphs = llm.engine.worker.graphs
        assert graphs is not None and (graphs.prefetcher is not None) == on
        outs = []
        for prompts in (PROMPTS[:3], PROMPTS):  # 3 rows (graph 4: fetches), 16 (does not)
            for o in llm.generate(prompts, PARAMS):
                c = o.outputs[0]
                outs.append([(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs,
                                                                  strict=True)])
        return outs
    finally:
        llm.engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_prefetch_changes_no_bit(
    checkpoint_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert 4 <= l2_prefetch.MAX_ROWS < 16
    path = checkpoint_factory("gpu-llama-prefetch", arch="llama", seed=6)
    assert _outputs(path, True, monkeypatch) == _outputs(path, False, monkeypatch)
