"""Programmatic dependent launch (``kernels/pdl.py``) on an sm_90+ GPU: a decode layer's
kernel chain and the engine's greedy tokens are bit for bit those without it (PDL moves
when kernels start, never what they compute; a missed wait shows as a race)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvscale.kernels import activation, pdl, rmsnorm, w4a16
from kvscale.server import LLM, SamplingParams
from tests.hf_reference import random_prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability 9.0+",
)

HIDDEN, INTER, GROUP = 4096, 14336, 128  # the 8B model's MLP


@pytest.fixture
def pdl_switch() -> Iterator[Callable[[bool], None]]:
    """``switch(on)``: kernels launched from then on use PDL or not; restored after."""
    before = os.environ.get("KVSCALE_PDL")

    def switch(on: bool) -> None:
        os.environ["KVSCALE_PDL"] = "1" if on else "0"
        assert pdl.reload_switch() is on
        assert bool(pdl.pdl_launch(torch.device("cuda"))) is on

    yield switch
    if before is None:
        os.environ.pop("KVSCALE_PDL", None)
    else:
        os.environ["KVSCALE_PDL"] = before
    pdl.reload_switch()


def _int4(k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 16, (k, n), generator=gen, device="cuda")
    scales = torch.rand(k // GROUP, n, generator=gen, device="cuda") * 0.02
    zeros = torch.randint(0, 16, (k // GROUP, n), generator=gen, device="cuda").to(torch.uint8)
    return w4a16.pack_int4_rows(codes), scales, zeros


def _mlp(x: torch.Tensor, res: torch.Tensor, norm_w: torch.Tensor, up, down) -> torch.Tensor:
    """add + RMSNorm -> gate_up GEMV -> SiLU-and-mul -> down GEMV, on one row."""
    rmsnorm.fused_add_rms_norm(x, res, norm_w, 1e-5)
    h = w4a16.w4a16_gemm(x, *up, group_size=GROUP)
    return w4a16.w4a16_gemm(activation.silu_and_mul(h), *down, group_size=GROUP)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_layers_kernels_give_the_same_bits_with_and_without_pdl(
    pdl_switch: Callable[[bool], None], graph: bool
) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    up, down = _int4(HIDDEN, 2 * INTER, gen), _int4(INTER, HIDDEN, gen)
    norm_w = torch.rand(HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    inputs = [
        torch.randn(2, 1, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(8)
    ]

    def run(on: bool) -> list[torch.Tensor]:
        pdl_switch(on)
        x = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
        res = torch.empty_like(x)
        outs = []
        if graph:
            x.copy_(inputs[0][0])
            res.copy_(inputs[0][1])
            _mlp(x, res, norm_w, up, down)  # first calls compile and allocate
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = x
                for _ in range(4):  # four layers' worth: PDL edges between the layers too
                    y = _mlp(y, res, norm_w, up, down)
        for xr in inputs:
            x.copy_(xr[0])
            res.copy_(xr[1])
            if graph:
                g.replay()
                outs.append(torch.cat([y, res]).clone())
            else:
                y = x
                for _ in range(4):
                    y = _mlp(y, res, norm_w, up, down)
                outs.append(torch.cat([y, res]).clone())
        torch.cuda.synchronize()
        return outs

    off, on = run(False), run(True)
    for a, b in zip(off, on, strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


def test_engine_greedy_tokens_are_the_same_with_and_without_pdl(
    pdl_switch: Callable[[bool], None], checkpoint_factory: Callable[..., Path]
) -> None:
    """bf16 engine with CUDA graphs and the Triton attention backend: decode steps run
    the norm, rotary + KV write, paged attention and SiLU kernels with PDL."""
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    prompts = random_prompts(12, (2, 90), seed=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        pdl_switch(on)
        llm = LLM(str(path), device="cuda", dtype="bfloat16", attention_backend="triton")
        tokens[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.core.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert tokens[False] == tokens[True]
