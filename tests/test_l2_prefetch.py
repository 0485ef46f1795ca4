"""The L2 prefetch of a small decode step's weights, without a GPU.

The kernels (``kvscale.kernels.l2_prefetch``) compile for Hopper and Ampere to the PTX
each mode asks for (their arithmetic runs in ``tests/kernels``, their effect on the GPU in
``tests/gpu/test_l2_prefetch_cuda.py``); the model names each layer's GEMMs in step order
at the start of the wait before it, only inside ``prefetching``; the switch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kvscale.server import LLM, SamplingParams
from kvscale.server.layers import l2_prefetch


class Recorder:
    """Stands in for ``WeightPrefetcher`` (which needs a CUDA stream): records the
    layers it is asked to fetch and the joins."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module, int | None]] = []
        self.joins = 0

    def fetch(self, layer: nn.Module, nbytes: int | None) -> None:
        self.calls.append((layer, nbytes))

    def join(self) -> None:
        self.joins += 1


def step_order(layers: Any, all_reduces: bool) -> list[tuple[nn.Module, int | None]]:
    """One forward's fetches: per layer qkv (behind the previous layer's sum and the
    norm), o (behind RoPE and attention) and, where an all-reduce follows o, gate_up's
    first ``ALL_REDUCE_BYTES``."""
    calls: list[tuple[nn.Module, int | None]] = []
    for layer in layers:
        calls += [(layer.self_attn.qkv_proj, None), (layer.self_attn.o_proj, None)]
        if all_reduces:
            calls.append((layer.mlp.gate_up_proj, l2_prefetch.ALL_REDUCE_BYTES))
    return calls


def check_recorded(rec: Recorder, layers: Any, all_reduces: bool, forwards: int) -> None:
    """``rec`` saw ``step_order`` once a forward, at least ``forwards`` times, and one join."""
    order = step_order(layers, all_reduces)
    n = len(rec.calls) // len(order)
    assert n >= forwards and len(rec.calls) == n * len(order)
    assert [(id(m), b) for m, b in rec.calls] == [(id(m), b) for m, b in order] * n
    assert rec.joins == 1


def test_the_model_names_each_layers_gemms_in_step_order(llama_ckpt: Path) -> None:
    llm = LLM(str(llama_ckpt), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    rec = Recorder()
    with l2_prefetch.prefetching(rec):  # type: ignore[arg-type]
        got = llm.generate([[5, 9, 2, 7]], params)[0].outputs[0].token_ids
    assert l2_prefetch._current is None  # the block restored "no prefetch"
    # one forward a token; TP=1: no all-reduce, no gate_up fetch
    check_recorded(rec, llm.engine.worker.model.model.layers, all_reduces=False, forwards=3)
    assert llm.generate([[5, 9, 2, 7]], params)[0].outputs[0].token_ids == got


def test_prefetch_outside_the_block_does_nothing() -> None:
    l2_prefetch.prefetch(nn.Linear(2, 2))  # no prefetcher: returns, touches nothing


def test_the_switch_and_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not l2_prefetch.supported(torch.device("cpu"))
    monkeypatch.setenv("KVSCALE_L2_PREFETCH", "0")
    assert not l2_prefetch.supported(torch.device("cuda"))  # asks no GPU once turned off


def test_dense_layers_offer_their_weight_and_others_nothing() -> None:
    from kvscale.server.layers.linear import RowParallelLinear
    from kvscale.server.parallel import SINGLE
    from kvscale.server.quantization.fp8 import Fp8LinearMethod

    dense = RowParallelLinear(64, 32, False, SINGLE, None)
    assert dense.linear_method.small_batch_weights(dense) == (dense.weight,)
    fp8_method = Fp8LinearMethod(per_channel=True, static_input=False)
    fp8 = RowParallelLinear(64, 32, False, SINGLE, fp8_method)
    assert fp8.linear_method.small_batch_weights(fp8) == ()


def _ptx(kernel: Any, sig: dict[str, str], consts: dict[str, Any], cc: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = sig | {n: "constexpr" for n in consts}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32)).asm["ptx"]


def _lines(ptx: str, needle: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if needle in line and "//" not in line]


@pytest.mark.parametrize("cc", [80, 90])
def test_the_kernels_compile_to_the_prefetches_asked_for(cc: int) -> None:
    """Compiled here for sm_80 and sm_90 (no GPU needed): a line prefetch a thread with
    L2's evict_last hint; on Hopper the bulk prefetch of 4 KiB; the load mode's loads
    carry evict_last and are 16 bytes wide."""
    from kvscale.kernels.l2_prefetch import BULK_BYTES, _l2_load_kernel, _l2_prefetch_kernel

    sig = {"src": "*i32", "sink": "*i32", "n_blocks": "i32"}
    line = _ptx(_l2_prefetch_kernel, sig,
                {"UNIT_WORDS": 32, "BLOCK": 128, "BULK": False, "BULK_BYTES": BULK_BYTES}, cc)
    assert _lines(line, "prefetch.global.L2::evict_last [")
    assert not _lines(line, "cp.async.bulk")
    if cc >= 90:
        bulk = _ptx(_l2_prefetch_kernel, sig,
                    {"UNIT_WORDS": 1024, "BLOCK": 128, "BULK": True, "BULK_BYTES": BULK_BYTES}, cc)
        asks = _lines(bulk, "cp.async.bulk.prefetch.L2.global [")
        assert asks and all(f"], {BULK_BYTES};" in a for a in asks), asks
    loads = _lines(_ptx(_l2_load_kernel, sig, {"BLOCK": 512}, cc), "ld.global")
    assert loads and all(".v4." in ld and "evict_last" in ld for ld in loads), loads[:2]
