"""The L2 prefetch of weights (``kernels/l2_prefetch.py``, ``server/layers/prefetch.py``):
its plan, the tensors it takes, and its kernel compiled for sm_90 here (no GPU needed).
On a GPU, ``tests/gpu/test_engine_cuda.py`` checks that the decode graphs with it give
the same tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvscale.kernels.l2_prefetch import (
    ALIGN,
    MAX_CHUNK,
    MIN_CHUNK,
    THREADS,
    dense_span,
    l2_prefetch,
    l2_prefetch_plan,
    l2_prefetch_supported,
)
from kvscale.server.config import EngineConfig
from kvscale.server.layers.prefetch import prefetch_weights, prefetchable


@pytest.mark.parametrize("nbytes", [16, 4096, 4112, 33_554_432, 117_440_512, 1_050_673_152])
@pytest.mark.parametrize("sms", [4, 132])
def test_the_plan_covers_every_byte_in_bounded_chunks(nbytes: int, sms: int) -> None:
    chunk, programs = l2_prefetch_plan(nbytes, sms)
    assert chunk % ALIGN == 0 and MIN_CHUNK <= chunk <= MAX_CHUNK
    threads = programs * THREADS
    assert threads * chunk >= nbytes  # every byte asked for
    assert (threads - THREADS) * chunk < nbytes  # and no program without work
    if nbytes >= sms * THREADS * MIN_CHUNK and chunk < MAX_CHUNK:
        assert programs <= sms  # one program an SM, the requests from every SM


def test_an_o_proj_of_the_8b_model_leaves_from_every_sm() -> None:
    chunk, programs = l2_prefetch_plan(4096 * 4096 * 2, 132)
    assert programs == 132 and chunk == 7952


def test_dense_span_takes_contiguous_tensors_and_transposed_matrices() -> None:
    w = torch.zeros(64, 32, dtype=torch.float16)
    assert dense_span(w) == (w.data_ptr(), 64 * 32 * 2)
    assert dense_span(w.t()) == (w.data_ptr(), 64 * 32 * 2)  # FP8 weights are stored so
    assert dense_span(w[:, :16]) is None
    assert dense_span(w[::2]) is None
    with pytest.raises(ValueError, match=r"shape \(64, 16\) with strides \(32, 1\)"):
        l2_prefetch(w[:, :16])


def test_a_layer_is_prefetched_whole_or_not_at_all() -> None:
    layer = nn.Linear(64, 32)  # 8,192 + 128 bytes
    layer.register_buffer("empty", torch.zeros(0))
    assert [t.shape for t in prefetchable(layer, 8_320)] == [(32, 64), (32,)]
    assert prefetchable(layer, 8_319) == []


def test_no_prefetch_outside_a_prefetching_forward() -> None:
    prefetch_weights(nn.Linear(4, 4))  # no forward context: nothing happens, nothing fails


def test_the_setting_and_where_it_applies() -> None:
    assert EngineConfig().l2_prefetch_max_batch == 0
    assert EngineConfig(l2_prefetch_max_batch=64).l2_prefetch_max_batch == 64
    with pytest.raises(ValueError, match="l2_prefetch_max_batch must be >= 0, got -1"):
        EngineConfig(l2_prefetch_max_batch=-1)
    assert not l2_prefetch_supported(torch.device("cpu"))


def test_the_kernel_compiles_to_bulk_prefetches_for_sm90() -> None:
    """ptxas accepts the instruction, and the kernel keeps it (its result is unused: an
    inline asm not marked impure would be removed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvscale.kernels.l2_prefetch import _l2_prefetch_kernel

    sig = {"base": "i64", "nbytes": "i64", "chunk": "i64", "BLOCK": "constexpr"}
    src = ASTSource(fn=_l2_prefetch_kernel, signature=sig, constexprs={"BLOCK": THREADS})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    lines = [x for x in kernel.asm["ptx"].splitlines() if "cp.async.bulk.prefetch.L2" in x]
    assert len(lines) == 1 and "@p" in lines[0]
    assert kernel.asm["cubin"]
