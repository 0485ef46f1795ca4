"""Piecewise CUDA graphs on the GPU: captured pieces against eager execution (GPU only).

Run on the GPU machine with the other GPU tests:
``KVSCALE_KERNEL_TESTS=1 python -m pytest tests/gpu/test_piecewise_cuda.py``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.worker.graph_dispatch import Dispatch, GraphDispatcher
from kvscale.server.worker.piecewise_graphs import PiecewiseGraphs
from tests.greedy_paths import (
    common_prefixes,
    greedy_logprobs,
    logprob_distance,
    mean_common_prefix,
)
from tests.hf_reference import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _release_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


PROMPTS = random_prompts(16, (2, 90), seed=1)
# chunked prefill (64-token steps), preemption (too few blocks), steps of 49-64 tokens
# above the largest bucket (eager) and decode steps of up to 16 sequences
STRESS = dict(
    max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=16, block_size=16, max_model_len=128
)
SIZES = [8, 16, 24, 32, 48]
PIECEWISE = dict(piecewise_capture_sizes=",".join(map(str, SIZES)), cuda_graph_max_batch=16)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class _Recorder:
    """Stands in for a worker's dispatcher and records the kind of each step."""

    def __init__(self, inner: GraphDispatcher) -> None:
        self.inner = inner
        self.kinds: list[str] = []

    def decode_size(self, num_seqs: int) -> int:
        return self.inner.decode_size(num_seqs)

    def dispatch(self, num_tokens: int, decode_graph_size: int = 0) -> Dispatch:
        d = self.inner.dispatch(num_tokens, decode_graph_size)
        self.kinds.append(d.kind)
        return d

    @classmethod
    def install(cls, llm: LLM) -> _Recorder:
        """A recorder put in front of ``llm``'s dispatcher."""
        w = llm.engine.worker
        rec = cls(w.dispatcher)
        w.dispatcher = rec  # type: ignore[assignment]
        return rec


def _run(path: Path, dtype: str, **kw: Any) -> tuple[list[list[int]], LLM, list[str]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, attention_backend="triton", **kw)
    rec = _Recorder.install(llm)
    outs = llm.generate(PROMPTS, GREEDY)
    llm.engine.worker.dispatcher = rec.inner
    return [o.outputs[0].token_ids for o in outs], llm, rec.kinds


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        ("full_and_piecewise", {}),  # the traced pieces (the default compiler)
        ("full_and_piecewise", {"piecewise_compiler": "inductor"}),
        # decode graphs and eager steps through the compiled pieces (1..16 tokens too)
        ("full_and_piecewise", {"compile": True, "piecewise_compiler": "inductor"}),
        ("piecewise", {"piecewise_compile_sizes": "16", "piecewise_compiler": "inductor"}),
        ("piecewise", {}),
    ],
)
def test_piecewise_graphs_match_eager_fp32(
    checkpoint_factory: Callable[..., Path], tmp_path: Path, mode: str, extra: dict[str, Any]
) -> None:
    """Mixed steps replayed from piecewise graphs (padded to buckets) give the eager
    tokens, token for token, under chunked prefill and preemption."""
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    eager, _, _ = _run(path, "float32", cuda_graph_mode="none", **STRESS)
    got, llm, kinds = _run(
        path,
        "float32",
        cuda_graph_mode=mode,
        compile_cache_dir=str(tmp_path),
        **extra,
        **PIECEWISE,
        **STRESS,
    )
    w = llm.engine.worker
    assert w.piecewise is not None
    assert all(p.captured_sizes == SIZES for p in w.piecewise.compile_backend.pieces)
    assert (w.graphs is not None) == (mode == "full_and_piecewise")
    assert "piecewise" in kinds and "eager" in kinds
    assert ("full" in kinds) == (mode == "full_and_piecewise")
    assert llm.engine.stats().num_preemptions > 0
    assert got == eager


def test_auto_mode_takes_both_kinds_of_graphs_for_a_plain_model(
    checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """``auto`` on one GPU with an unquantized model: decode graphs for decode-only steps,
    piecewise graphs of the traced pieces for mixed ones, the eager tokens."""
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    eager, _, _ = _run(path, "float32", cuda_graph_mode="none", **STRESS)
    got, llm, kinds = _run(
        path,
        "float32",
        cuda_graph_mode="auto",
        compile_cache_dir=str(tmp_path),
        **PIECEWISE,
        **STRESS,
    )
    w = llm.engine.worker
    assert w.cuda_graph_mode == "full_and_piecewise"
    assert w.piecewise is not None and w.graphs is not None
    assert w.piecewise.compile_backend.compiler.compiler == "eager"
    assert {"full", "piecewise", "eager"} <= set(kinds)
    assert got == eager


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_piecewise_graphs_track_eager_bf16(
    checkpoint_factory: Callable[..., Path], tmp_path: Path, compiler: str
) -> None:
    """bf16: Inductor fuses and rounds differently from the hand-written kernels, and a
    GEMM padded to its bucket may pick another kernel, so the greedy paths of a random
    model drift apart after near-ties; they must agree about as long as eager bf16 agrees
    with eager fp32."""
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    fp32, _, _ = _run(path, "float32", cuda_graph_mode="none", **STRESS)
    ref, _, _ = _run(path, "bfloat16", cuda_graph_mode="none", **STRESS)
    got, llm, kinds = _run(
        path,
        "bfloat16",
        cuda_graph_mode="full_and_piecewise",
        piecewise_compiler=compiler,
        compile_cache_dir=str(tmp_path),
        **PIECEWISE,
        **STRESS,
    )
    assert "piecewise" in kinds and llm.engine.stats().num_preemptions > 0
    assert [g[0] for g in got] == [r[0] for r in ref]
    piecewise_vs_eager = mean_common_prefix(got, ref)
    bf16_vs_fp32 = mean_common_prefix(ref, fp32)
    print(
        f"bf16 common prefix: piecewise vs eager {piecewise_vs_eager:.1f}, "
        f"eager bf16 vs fp32 {bf16_vs_fp32:.1f} (of 24 tokens)"
    )
    assert piecewise_vs_eager >= 0.8 * bf16_vs_fp32


def _greedy_logprobs(path: Path, **kw: Any) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """bf16 greedy tokens, their own logprobs and each step's dispatch kind."""
    recorders: list[_Recorder] = []
    tokens, logprobs = greedy_logprobs(
        path, PROMPTS, lambda llm: recorders.append(_Recorder.install(llm)), **kw
    )
    return tokens, logprobs, recorders[0].kinds


def test_fp8_piecewise_graphs_track_eager(
    checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """FP8 weights with piecewise graphs for mixed steps (``torch._scaled_mm`` and the
    fused quantizing norms inside the pieces), against the same FP8 engine eager, under
    chunked prefill and preemption. On a random model's flat logits greedy paths part at
    near ties (the FP8 decode-graph test in ``test_engine_cuda.py`` says why), so the
    yardstick is logprobs: along the tokens both took (at least the first), the pieces'
    must stay within a third of the distance between FP8 and bf16 eager."""
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    fp8 = dict(quantization="fp8", **STRESS)
    eager, lp_eager, _ = _greedy_logprobs(path, cuda_graph_mode="none", **fp8)
    _, lp_bf16, _ = _greedy_logprobs(path, cuda_graph_mode="none", **STRESS)
    got, lp_got, kinds = _greedy_logprobs(
        path,
        cuda_graph_mode="full_and_piecewise",
        compile_cache_dir=str(tmp_path),
        **PIECEWISE,
        **fp8,
    )
    assert "piecewise" in kinds and "full" in kinds

    common = [max(1, n) for n in common_prefixes(got, eager)]
    pieces_vs_eager = logprob_distance(lp_got, lp_eager, common)
    fp8_vs_bf16 = logprob_distance(lp_eager, lp_bf16, [1] * len(PROMPTS))
    print(
        f"FP8 logprobs: pieces vs eager {pieces_vs_eager:.4f} over {sum(common)} tokens, "
        f"FP8 vs bf16 {fp8_vs_bf16:.4f}"
    )
    assert fp8_vs_bf16 > 0
    assert pieces_vs_eager <= fp8_vs_bf16 / 3


def test_mixed_steps_launch_without_a_device_sync(
    checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Launching a step replayed from piecewise graphs never waits for the GPU (CUDA sync
    debug mode turns any implicit sync into an error), with sampled, penalized, seeded
    and logprob rows, as the decode-graph and eager steps already do."""
    path = checkpoint_factory("gpu-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    llm = LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=16,
        max_model_len=256,
        num_kv_blocks=256,  # not sized from free memory: earlier tests' pools may linger
        max_num_batched_tokens=256,
        cuda_graph_mode="full_and_piecewise",
        compile_cache_dir=str(tmp_path),
        cuda_graph_max_batch=8,
        piecewise_capture_sizes="16,64,256",
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
    w = eng.worker
    launch = w.launch
    kinds: list[str] = []

    def strict_launch(step):  # type: ignore[no-untyped-def]
        kinds.append(w.dispatcher.dispatch(step.num_tokens, step.graph_size).kind)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    w.launch = strict_launch  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS[:12], [mixed[i % 4] for i in range(12)])
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert all(n == 20 if i % 4 < 3 else 5 <= n <= 20 for i, n in enumerate(lens))
    assert "piecewise" in kinds and "full" in kinds


def test_captures_release_earlier_outputs_and_replays_check_addresses(
    checkpoint_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capturing every bucket holds no activations afterwards (each piece keeps views of
    its outputs, not the memory), and in debug mode every replay finds its inputs where
    the capture saw them."""
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    growth: list[int] = []
    capture = PiecewiseGraphs.capture

    def measured(self: PiecewiseGraphs) -> None:
        # cuBLAS allocates a workspace (32 MiB on an H100) for each stream it first runs
        # on, held for the process: allocated before the measurement, not activations
        with torch.cuda.stream(self.capture_stream):
            torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        capture(self)
        growth.append(torch.cuda.memory_allocated() - before)

    monkeypatch.setattr(PiecewiseGraphs, "capture", measured)
    _, _, kinds = _run(
        path,
        "float32",
        cuda_graph_mode="piecewise",
        compile_debug=True,
        compile_cache_dir=str(tmp_path),
        **PIECEWISE,
        **STRESS,
    )
    assert "piecewise" in kinds
    assert growth and growth[0] < 1 << 20, growth  # under 1 MiB kept after 5 buckets
    assert (tmp_path / "split_graph.py").is_file()


def test_a_restart_loads_compiled_pieces_from_the_cache(
    checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = checkpoint_factory("gpu-llama", arch="llama", seed=4)
    kw = dict(
        cuda_graph_mode="full_and_piecewise",
        piecewise_compiler="inductor",  # the eager compiler keeps nothing on disk
        compile_cache_dir=str(tmp_path),
    )
    first, llm1, _ = _run(path, "float32", **kw, **PIECEWISE, **STRESS)
    pw1 = llm1.engine.worker.piecewise
    assert pw1 is not None
    cold = pw1.compile_seconds
    assert pw1.compile_backend.compiler.stats.compiled == 3  # first, middle, last pieces
    del llm1, pw1
    gc.collect()
    second, llm2, _ = _run(path, "float32", **kw, **PIECEWISE, **STRESS)
    pw2 = llm2.engine.worker.piecewise
    assert pw2 is not None
    stats = pw2.compile_backend.compiler.stats
    print(
        f"piecewise start-up: compile {cold:.1f} s cold, {pw2.compile_seconds:.1f} s from "
        f"the cache; capture {pw2.capture_seconds:.1f} s"
    )
    assert (stats.compiled, stats.loaded) == (0, 3)
    assert second == first


@pytest.mark.parametrize("mode", ["full_decode_only", "full_and_piecewise"])
def test_a_closed_engine_frees_its_gpu_memory(llama_ckpt: Path, mode: str) -> None:
    """After shutdown and the last reference the weights are garbage and their memory is
    free: the 8B bench's third piecewise engine in one process ran out of memory
    (2026-11-26). On failure, the referrers of the weights say what holds them."""
    import weakref

    llm = LLM(str(llama_ckpt), device="cuda", cuda_graph_mode=mode, **PIECEWISE, **STRESS)
    llm.generate(PROMPTS[:2], GREEDY)
    weight = llm.engine.worker.model.model.embed_tokens.weight
    ref = weakref.ref(weight)
    llm.engine.core.shutdown()
    del llm, weight
    gc.collect()
    holders = [type(r).__name__ for r in gc.get_referrers(ref())] if ref() is not None else []
    assert ref() is None, f"the weights are still held by {holders}"
