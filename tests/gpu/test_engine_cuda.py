"""The engine on CUDA: Triton kernels against the pure-torch backend (GPU machine only)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.quantization.dense import BLAS_ENV
from tests.greedy_paths import (
    common_prefixes,
    greedy_logprobs,
    logprob_distance,
    mean_common_prefix,
)
from tests.hf_reference import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _release_gpu_memory() -> Iterator[None]:
    """Each test's engines (KV pools sized from free memory) are gone before the next."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


PROMPTS = random_prompts(16, (2, 90), seed=1)
# chunked prefill (32-token budget) and preemption (too few blocks) at once
STRESS = dict(
    max_num_batched_tokens=32, max_num_seqs=16, num_kv_blocks=16, block_size=16, max_model_len=128
)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A fixed KV pool for tests that build several engines: one sized from free memory
# counts an earlier engine still alive (its pool, its graphs) against the next.
FIXED_POOL = dict(num_kv_blocks=256)


def _run(path: Path, backend: str, dtype: str, **kw: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cuda", dtype=dtype, attention_backend=backend, **kw)
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs], llm


def _tokens(path: Path, backend: str, dtype: str, **kw: object) -> list[list[int]]:
    """``_run``'s tokens; the engine is released (and its GPU memory) before returning."""
    tokens, llm = _run(path, backend, dtype, **kw)
    llm.engine.core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_triton_matches_torch_backend_fp32(
    checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    path = checkpoint_factory(f"gpu-{arch}", arch=arch, seed=4)
    ref = _tokens(path, "torch", "float32", **STRESS)
    got, llm = _run(path, "triton", "float32", **STRESS)
    assert llm.engine.stats().num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert got == ref
    assert ref == hf_greedy(path, PROMPTS, 24)


def test_triton_matches_torch_backend_bf16(checkpoint_factory: Callable[..., Path]) -> None:
    """bf16 sums in other orders (and flash attention rounds P to bf16), so greedy paths of
    a random model drift apart after near-ties. Yardstick: the kernels must track the
    torch backend in bf16 about as long as bf16 tracks fp32 on the same backend."""
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    fp32 = _tokens(path, "torch", "float32", **STRESS)
    ref = _tokens(path, "torch", "bfloat16", **STRESS)
    got, llm = _run(path, "triton", "bfloat16", **STRESS)
    assert llm.engine.stats().num_preemptions > 0
    assert [g[0] for g in got] == [r[0] for r in ref]
    kernels_vs_torch = mean_common_prefix(got, ref)
    bf16_vs_fp32 = mean_common_prefix(ref, fp32)
    print(
        f"bf16 common prefix: kernels vs torch {kernels_vs_torch:.1f}, "
        f"torch bf16 vs fp32 {bf16_vs_fp32:.1f} (of 24 tokens)"
    )
    assert kernels_vs_torch >= 0.8 * bf16_vs_fp32


def test_kv_pool_sized_from_gpu_memory(checkpoint_factory: Callable[..., Path]) -> None:
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    llm = LLM(str(path), device="cuda", gpu_memory_utilization=0.5)
    _free, total = torch.cuda.mem_get_info()
    pool = llm.engine.worker.num_kv_blocks * llm.engine.worker.bytes_per_block
    assert 0.3 * total < pool < 0.5 * total
    if not any(k in os.environ for k in BLAS_ENV):
        # decode graphs of up to 64 rows were captured under cuBLASLt (NOTES e66); every
        # other step keeps the process's cuBLAS
        assert llm.engine.worker.graphs is not None
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublas
    out = llm.generate(PROMPTS[:2], GREEDY)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)


def test_cuda_graphs_match_eager(checkpoint_factory: Callable[..., Path]) -> None:
    """Decode steps replayed from CUDA graphs (padded batch sizes) give the eager tokens."""
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    eager = _tokens(path, "triton", "float32", enforce_eager=True, **STRESS)
    graphs, llm = _run(path, "triton", "float32", cuda_graph_max_batch=16, **STRESS)
    dg = llm.engine.worker.graphs
    assert dg is not None
    assert dg.batch_sizes == [1, 2, 4, 8, 16]
    assert graphs == eager
    # every graph's logits are the first rows of one buffer, not a buffer per graph
    assert dg.logits_buf is not None and dg.logits_buf.shape[0] == 16
    for bs, logits in dg.logits.items():
        assert logits.data_ptr() == dg.logits_buf.data_ptr() and logits.shape[0] == bs


def test_torch_compile_with_cuda_graphs_matches_eager(
    checkpoint_factory: Callable[..., Path],
) -> None:
    """Inductor-compiled layers around the attention op, replayed from CUDA graphs."""
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    eager = _tokens(path, "triton", "float32", enforce_eager=True, **STRESS)
    compiled = _tokens(path, "triton", "float32", compile=True, cuda_graph_max_batch=16, **STRESS)
    assert compiled == eager


def test_steps_launch_without_a_device_sync(checkpoint_factory: Callable[..., Path]) -> None:
    """Preparing and launching a step never waits for the GPU (CUDA sync debug mode turns
    any implicit sync into an error): greedy and sampled rows, top-k/top-p/min-p,
    penalties, seeds, logprobs and min_tokens, in graph-replayed and eager steps."""
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    llm = LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=16,
        cuda_graph_max_batch=8,
        max_model_len=256,
        num_kv_blocks=256,  # not sized from free memory: earlier tests' pools may linger
    )
    eng = llm.engine
    mixed = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, max_tokens=20, ignore_eos=True, seed=7
        ),
        SamplingParams(
            temperature=1.0,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            max_tokens=20,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.5, logprobs=3, min_tokens=5, max_tokens=20),
    ]
    llm.generate(PROMPTS[:4], mixed)  # warm-up: kernel compilation may sync
    launch = eng.worker.launch
    graph_steps = []

    def strict_launch(step):  # type: ignore[no-untyped-def]
        graph_steps.append(step.max_query_len == 1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    eng.worker.launch = strict_launch  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS[:12], [mixed[i % 4] for i in range(12)])
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert all(n == 20 if i % 4 < 3 else 5 <= n <= 20 for i, n in enumerate(lens))
    assert any(graph_steps) and not all(graph_steps)


def test_fp8_linear_on_cuda_matches_the_dequantized_product() -> None:
    """``torch._scaled_mm`` with row-wise scales on the GPU (bf16 out), odd token counts."""
    from kvscale.server.quantization.fp8 import fp8_linear, quantize_rows

    torch.manual_seed(0)
    for m in (1, 7, 33, 256):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
        wq, ws = quantize_rows(w)
        y = fp8_linear(x, wq, ws.view(-1), None)
        xq, xs = quantize_rows(x)
        ref = (xq.float() * xs) @ (wq.float() * ws).T
        assert y.dtype == torch.bfloat16
        assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2  # bf16 output rounding


def test_fp8_linear_takes_the_tiles_at_few_rows_in_and_out_of_graphs() -> None:
    """With the ops routed to the kernels, FP8 products of at most ``TILE_MAX_ROWS`` rows
    run ``tile_mm``'s tiles (by the TMA), more rows cuBLAS's; both match the dequantized
    product, and a CUDA graph that captured the tiles replays on new inputs as eager."""
    from kvscale.server.layers import ops
    from kvscale.server.quantization.fp8 import TILE_MAX_ROWS, fp8_linear, quantize_rows

    torch.manual_seed(0)
    for n in (1024, 28672):  # narrow and wide tiles
        w = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
        wq, ws = quantize_rows(w)
        with ops.kernels(True):
            for m in (1, 5, TILE_MAX_ROWS, TILE_MAX_ROWS + 1):
                x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]
                ) as prof:
                    y = fp8_linear(x, wq, ws.view(-1), None)
                    torch.cuda.synchronize()
                names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
                tiled = any("tile_mm" in name for name in names)
                assert tiled == (m <= TILE_MAX_ROWS), (m, names)
                xq, xs = quantize_rows(x)
                ref = (xq.float() * xs) @ (wq.float() * ws).T
                assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
            static = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
            fp8_linear(static, wq, ws.view(-1), None)  # compiled before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fp8_linear(static, wq, ws.view(-1), None)
            for _ in range(2):
                static.copy_(torch.randn_like(static))
                graph.replay()
                assert torch.equal(out, fp8_linear(static, wq, ws.view(-1), None))


def test_the_head_takes_the_tiles_at_few_rows() -> None:
    """With the ops routed to the kernels, heads of at most ``HEAD_TILE_MAX_ROWS`` rows run
    ``tile_mm``, into a graph's buffer or not; more rows torch's GEMM; the logits match."""
    import torch.nn.functional as F

    from kvscale.server.layers import ops
    from kvscale.server.layers.embedding import HEAD_TILE_MAX_ROWS, ParallelLMHead
    from kvscale.server.parallel import ParallelState

    torch.manual_seed(0)
    head = ParallelLMHead(32000, 4096, ParallelState()).cuda().to(torch.bfloat16)
    head.weight.data.normal_(0, 4096**-0.5)
    buffer = torch.empty(HEAD_TILE_MAX_ROWS + 1, 32000, device="cuda", dtype=torch.bfloat16)
    with ops.kernels(True):
        for m in (1, 16, 17, HEAD_TILE_MAX_ROWS, HEAD_TILE_MAX_ROWS + 1):
            h = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(h.float(), head.weight.float())
            for out in (None, buffer[:m]):
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]
                ) as prof:
                    logits = head.compute_logits(h, out)
                    torch.cuda.synchronize()
                names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
                assert any("tile_mm" in n for n in names) == (m <= HEAD_TILE_MAX_ROWS), names
                assert out is None or logits.data_ptr() == out.data_ptr()
                assert ((logits.float() - ref).norm() / ref.norm()).item() < 1e-2


def _assert_fp8_graphs_track_eager(
    path: Path, graphs: list[list[int]], eager: list[list[int]], kw: dict[str, object]
) -> None:
    """FP8 with graphs against eager, by logprobs. bf16 out of ``torch._scaled_mm``:
    cuBLASLt picks its algorithm by token count and capture mode, and per-token FP8
    activation scales turn a last-bit difference into a code step, so on a random model's
    flat logits greedy paths part at near ties (seen: H200, after 15 tokens; H100, after
    fewer than 4). Yardstick: along the tokens both took, graphs' logprobs must stay
    within a third of the distance between FP8 and bf16 eager themselves."""
    first = [g[0] == e[0] for g, e in zip(graphs, eager, strict=True)]
    assert all(first)  # the prefill runs eagerly in both
    lp_graphs = greedy_logprobs(path, PROMPTS, **kw)[1]
    lp_eager = greedy_logprobs(path, PROMPTS, enforce_eager=True, **kw)[1]
    no_fp8 = {k: v for k, v in kw.items() if k not in ("quantization", "kv_cache_dtype")}
    lp_bf16 = greedy_logprobs(path, PROMPTS, enforce_eager=True, **no_fp8)[1]

    common = common_prefixes(graphs, eager)
    graphs_vs_eager = logprob_distance(lp_graphs, lp_eager, common)
    first_token = [1] * len(PROMPTS)  # the bf16 model's tokens differ from FP8's after that
    fp8_vs_bf16 = logprob_distance(lp_eager, lp_bf16, first_token)
    print(f"FP8 logprobs: graphs vs eager {graphs_vs_eager:.4f}, FP8 vs bf16 {fp8_vs_bf16:.4f}")
    assert fp8_vs_bf16 > 0
    assert graphs_vs_eager <= fp8_vs_bf16 / 3


def test_fp8_engine_with_cuda_graphs_matches_eager(checkpoint_factory: Callable[..., Path]) -> None:
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    kw = dict(quantization="fp8", **FIXED_POOL)
    eager = _tokens(path, "triton", "bfloat16", enforce_eager=True, **kw)
    graphs, llm = _run(path, "triton", "bfloat16", **kw)
    assert llm.engine.worker.graphs is not None
    _assert_fp8_graphs_track_eager(path, graphs, eager, kw)


def test_fp8_activations_quantized_by_the_norms_track_the_unfused_kernels(
    checkpoint_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 weights with the norm and SiLU-and-mul kernels quantizing their outputs for the
    GEMM after them, against the same engine quantizing them in kernels of their own
    (``fp8_input_group`` None). The codes are those of the unfused kernels up to the fused
    norm's order of summation; yardstick as above: along the tokens both took, within a
    third of the distance between the unfused engine and bf16."""
    from kvscale.server.quantization.fp8 import Fp8LinearMethod

    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    kw = dict(quantization="fp8", enforce_eager=True, **FIXED_POOL)

    def greedy(**extra: object) -> tuple[list[list[int]], list[list[float]], int | None]:
        """Greedy tokens, their logprobs, and the down projection's ``fp8_input_group``."""
        seen: list[int | None] = []

        def look(llm: LLM) -> None:
            down = llm.engine.worker.model.model.layers[1].mlp.down_proj
            seen.append(getattr(down, "fp8_input_group", None))

        tokens, logprobs = greedy_logprobs(path, PROMPTS, look, **{**kw, **extra})
        return tokens, logprobs, seen[0]

    got, got_lp, fused = greedy()
    with monkeypatch.context() as patch:
        patch.setattr(Fp8LinearMethod, "fp8_input_group", lambda self, k: None)
        want, want_lp, unfused = greedy()
        bf16_lp = greedy(quantization=None)[1]
    assert fused is not None and unfused is None

    common = common_prefixes(got, want)
    fused_vs_unfused = logprob_distance(got_lp, want_lp, common)
    fp8_vs_bf16 = logprob_distance(want_lp, bf16_lp, [1] * len(PROMPTS))
    print(f"FP8 logprobs: fused vs unfused {fused_vs_unfused:.4f} over {sum(common)} tokens, "
          f"FP8 vs bf16 {fp8_vs_bf16:.4f}")  # fmt: skip
    assert sum(common) >= 2 * len(PROMPTS)
    assert fused_vs_unfused <= fp8_vs_bf16 / 3


def test_fp8_kv_cache_triton_matches_torch_backend(checkpoint_factory: Callable[..., Path]) -> None:
    """An FP8 KV cache through the Triton kernels (write, decode, prefill; chunked prefill
    and preemption forced) against the torch backend on the same calibrated scales: the
    same bytes in the cache, so the same greedy tokens up to accumulation order (fp32)."""
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    ref, ref_llm = _run(path, "torch", "float32", kv_cache_dtype="fp8", **STRESS)
    got, llm = _run(path, "triton", "float32", kv_cache_dtype="fp8", **STRESS)
    assert llm.engine.worker.kv_pool.k_scales == pytest.approx(
        ref_llm.engine.worker.kv_pool.k_scales
    )
    assert llm.engine.stats().num_preemptions > 0
    assert mean_common_prefix(got, ref) >= 20  # of 24: at most a late near tie apart


def test_fp8_kv_cache_with_cuda_graphs_matches_eager(
    checkpoint_factory: Callable[..., Path],
) -> None:
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    kw = dict(quantization="fp8", kv_cache_dtype="fp8", **FIXED_POOL)
    eager = _tokens(path, "triton", "bfloat16", enforce_eager=True, **kw)
    graphs, llm = _run(path, "triton", "bfloat16", **kw)
    assert llm.engine.worker.graphs is not None
    assert llm.engine.worker.kv_pool.layers[0].k.dtype == torch.float8_e4m3fn
    _assert_fp8_graphs_track_eager(path, graphs, eager, kw)
