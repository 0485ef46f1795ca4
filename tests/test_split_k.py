"""Split-K products of o_proj and down_proj, summed by the residual add + RMSNorm after
them (``RowParallelLinear.split_k``): the products, the layer's choice by row count,
the norm's sum and the engine's greedy tokens against transformers with the path on
(CPU; the norm's kernel is tested in ``tests/kernels/test_elementwise.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.layers.layernorm import RMSNorm
from kvscale.server.layers.linear import SPLIT_K_MAX_ROWS, RowParallelLinear
from kvscale.server.models.llama import default_split_k
from kvscale.server.parallel import SINGLE, ParallelState
from kvscale.server.quantization.dense import split_k_products
from tests.hf_reference import hf_greedy, random_prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_products_sum_to_the_product(dtype: torch.dtype, parts: int) -> None:
    x = torch.randn(3, 64, dtype=dtype)
    w = torch.randn(48, 64, dtype=dtype)
    got = split_k_products(x, w, parts)
    assert got.shape == (parts, 3, 48) and got.dtype == torch.float32
    want = x.float() @ w.float().t()
    torch.testing.assert_close(got.sum(0), want, atol=1e-4, rtol=1e-4)
    # each product is its slice of K's
    k = 64 // parts
    torch.testing.assert_close(got[-1], x[:, -k:].float() @ w[:, -k:].float().t())


def test_the_layer_splits_at_few_rows_only() -> None:
    torch.manual_seed(0)
    layer = RowParallelLinear(64, 32, False, SINGLE, split_k=2)
    layer.weight.data.normal_()
    few = torch.randn(SPLIT_K_MAX_ROWS, 64)
    many = torch.randn(SPLIT_K_MAX_ROWS + 1, 64)
    parts = layer(few)
    assert parts.shape == (2, SPLIT_K_MAX_ROWS, 32)
    torch.testing.assert_close(parts.sum(0), few @ layer.weight.t())
    assert layer(many).shape == (SPLIT_K_MAX_ROWS + 1, 32)
    # K not divisible by the count: the method declines and the layer multiplies whole
    odd = RowParallelLinear(63, 32, False, SINGLE, split_k=2)
    assert odd(torch.randn(2, 63)).shape == (2, 32)


def test_split_k_needs_one_rank_and_no_bias() -> None:
    with pytest.raises(ValueError, match="without bias on one rank"):
        RowParallelLinear(64, 32, True, SINGLE, split_k=2)
    with pytest.raises(ValueError, match="without bias on one rank"):
        RowParallelLinear(64, 32, False, ParallelState(0, 2), split_k=2)


def test_default_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSCALE_SPLIT_K", raising=False)
    assert default_split_k(SINGLE) == 1  # built on the CPU: off
    monkeypatch.setenv("KVSCALE_SPLIT_K", "3")
    assert default_split_k(SINGLE) == 3
    assert default_split_k(ParallelState(0, 2)) == 1  # the ranks' sum is the norm's
    for bad in ("0", "two"):
        monkeypatch.setenv("KVSCALE_SPLIT_K", bad)
        with pytest.raises(ValueError, match=f"KVSCALE_SPLIT_K must be .*{bad!r}"):
            default_split_k(SINGLE)


def test_the_norm_sums_the_products() -> None:
    """``RMSNorm`` with the residual: products in, the same as their sum in; with an FP8
    group asked for (a quantized next layer), the products are summed first."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    parts = torch.randn(2, 5, 64)
    res = torch.randn(5, 64)
    r_a, r_b = res.clone(), res.clone()
    got, got_res = norm(parts, r_a)
    want, want_res = norm(parts.sum(0), r_b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_res, want_res)
    q, _ = norm(parts, res.clone(), fp8_group=64)
    q_want, _ = norm(parts.sum(0), res.clone(), fp8_group=64)
    assert torch.equal(q.codes.float(), q_want.codes.float())


def test_engine_greedy_tokens_with_split_k(
    llama_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of up to 8 sequences take the split path; prefill does not."""
    prompts = random_prompts(6, (3, 40), seed=7)
    expected = hf_greedy(llama_ckpt, prompts, 10)
    monkeypatch.setenv("KVSCALE_SPLIT_K", "2")
    llm = LLM(str(llama_ckpt), device="cpu")
    splits: list[int] = []
    for layer in llm.engine.worker.model.model.layers:
        assert layer.self_attn.o_proj.split_k == 2 and layer.mlp.down_proj.split_k == 2
        layer.mlp.down_proj.register_forward_hook(lambda m, a, out: splits.append(out.dim()))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert 3 in splits and 2 in splits  # decode steps split, the prefill step did not
