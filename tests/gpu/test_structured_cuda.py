"""Structured outputs, logit_bias and prompt logprobs on CUDA (GPU machine only): token
bitmasks and biases applied on the device, decode forward passes replayed from CUDA
graphs while constrained rows sample after the previous step's tokens are read."""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.layers.sampler import apply_token_bitmask
from kvscale.server.structured.params import StructuredOutputsParams as SO
from tests.hf_reference import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = random_prompts(12, (8, 60), seed=3)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def _release_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def test_bitmask_on_cuda_equals_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 32000, generator=gen)
    rows = torch.tensor([1, 4, 7])
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 1000), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    want = apply_token_bitmask(logits.clone(), rows, bitmask)
    got = apply_token_bitmask(logits.cuda(), rows.cuda(), bitmask.cuda()).cpu()
    assert torch.equal(got, want)


def test_constrained_and_free_rows_share_graph_steps(llama_ckpt: Path) -> None:
    llm = LLM(str(llama_ckpt), device="cuda", dtype="float32", max_num_seqs=16)
    assert llm.engine.worker.graphs is not None  # decode forwards replay CUDA graphs
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[::2], free)]
    params = [
        free if i % 2 == 0
        else SamplingParams(temperature=1.0, seed=i, max_tokens=96,
                            structured_outputs=SO(json=SCHEMA) if i % 4 == 1
                            else SO(regex=r"[a-z]{2}-[0-9]{3}"))
        for i in range(len(PROMPTS))
    ]  # fmt: skip
    outs = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs[::2]] == alone
    for i, o in enumerate(outs):
        text = o.outputs[0].text
        if i % 4 == 1:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif i % 4 == 3:
            assert re.fullmatch(r"[a-z]{2}-[0-9]{3}", text), text


def test_logit_bias_and_prompt_logprobs_on_cuda(llama_ckpt: Path) -> None:
    cpu = LLM(str(llama_ckpt), device="cpu", num_kv_blocks=64)
    gpu = LLM(str(llama_ckpt), device="cuda", dtype="float32")
    p = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1, logit_bias={77: 100.0})
    a, b = cpu.generate(PROMPTS[:3], p), gpu.generate(PROMPTS[:3], p)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == [77] * 4
        assert x.prompt_logprobs is not None and y.prompt_logprobs is not None
        for ex, ey, tok in zip(
            x.prompt_logprobs[1:], y.prompt_logprobs[1:], x.prompt_token_ids[1:], strict=True
        ):
            assert ex is not None and ey is not None
            assert abs(ex[tok].logprob - ey[tok].logprob) < 1e-3
