"""Checkpoints stored in bf16 and fp16 load and run (upcast to fp32 on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from tests.hf_reference import hf_greedy, random_prompts

PROMPTS = random_prompts(4, (3, 20), seed=3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint(checkpoint_factory: Callable[..., Path], dtype: str) -> None:
    path = checkpoint_factory(f"llama-{dtype}", arch="llama", dtype=dtype, seed=9)
    llm = LLM(str(path), device="cpu")
    assert llm.engine.dtype == torch.float32
    assert llm.engine.model_config.dtype == getattr(torch, dtype)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS, 8)


def test_explicit_bf16_runs_on_cpu(llama_ckpt: Path) -> None:
    llm = LLM(str(llama_ckpt), device="cpu", dtype="bfloat16")
    assert llm.engine.worker.model.lm_head.weight.dtype == torch.bfloat16
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
