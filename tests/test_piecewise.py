"""Piecewise compilation on CPU: buckets and dispatch, the graph split, padding, and
compiled pieces (Inductor) against eager execution. CUDA-graph capture itself is
GPU-only (tests/gpu/test_piecewise_cuda.py); everything around it runs here."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.compilation.config import (
    CompilationConfig,
    auto_graph_mode,
    bucket_for,
    default_capture_sizes,
)
from kvscale.server.compilation.split import op_target_name
from kvscale.server.config import EngineConfig
from kvscale.server.worker.graph_dispatch import Dispatch, GraphDispatcher
from kvscale.server.worker.step import SamplingPlan, StepInput
from kvscale.server.worker.worker import Worker
from tests.hf_reference import random_prompts

PROMPTS = random_prompts(8, (2, 70), seed=3)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# chunked prefill (48-token steps), preemption (too few blocks), and steps of 33-48
# tokens above the largest bucket (32), which run eagerly
STRESS = dict(
    device="cpu",
    max_num_batched_tokens=48,
    max_num_seqs=8,
    num_kv_blocks=14,
    block_size=8,
    max_model_len=96,
)
PIECEWISE = dict(cuda_graph_mode="piecewise", piecewise_capture_sizes="8,16,32")
INDUCTOR = dict(piecewise_compiler="inductor")


# ---- buckets, settings, dispatch (pure) -------------------------------------------------
def test_default_capture_sizes_are_buckets_about_12_percent_apart() -> None:
    sizes = default_capture_sizes(1024)
    assert sizes[:8] == [8, 16, 24, 32, 40, 48, 56, 64]
    assert sizes[-1] == 1024 and sizes == sorted(set(sizes))
    gaps = [(b - a) / a for a, b in itertools.pairwise(sizes[8:])]
    assert max(gaps) <= 0.25 and len(sizes) == 40  # at most 25% padding past 64 tokens
    # compute-bound sizes (an 8B model past ~256 tokens) pad by at most 32 tokens
    assert all(b - a == 32 for a, b in itertools.pairwise(sizes[sizes.index(256) :]))
    assert default_capture_sizes(2048)[40:42] == [1088, 1152]
    assert default_capture_sizes(100)[-1] == 100
    assert default_capture_sizes(3000)[-1] == 3000
    assert default_capture_sizes(0) == []
    cfg = CompilationConfig.from_engine(EngineConfig(device="cpu", max_num_batched_tokens=512))
    assert cfg.capture_sizes[-1] == 512  # never above the step budget


def test_buckets_and_dispatch_are_general_over_token_counts() -> None:
    assert bucket_for([8, 16, 32], 1) == 8
    assert bucket_for([8, 16, 32], 16) == 16
    assert bucket_for([8, 16, 32], 17) == 32
    assert bucket_for([8, 16, 32], 33) is None
    d = GraphDispatcher(decode_sizes=(1, 2, 4, 8), token_sizes=tuple(default_capture_sizes(1024)))
    assert d.decode_size(3) == 4 and d.decode_size(9) == 0
    assert d.dispatch(4, decode_graph_size=4) == Dispatch("full", 4)
    assert d.dispatch(64 + 490) == Dispatch("piecewise", 576)  # a prompt joins 64 decodes
    # a speculative verify step, k = 3 drafts for 37 sequences: 148 tokens
    assert d.dispatch(37 * (3 + 1)) == Dispatch("piecewise", 160)
    assert d.dispatch(300) == Dispatch("piecewise", 320)  # decode above the decode graphs
    assert d.dispatch(1025) == Dispatch("eager", 0)
    none = GraphDispatcher()
    assert none.decode_size(1) == 0 and none.dispatch(8) == Dispatch("eager", 0)


PLAIN = dict(
    cuda=True,
    triton=True,
    quantized=False,
    fp8_at_load=False,
    kv_quantized=False,
    tensor_parallel=False,
    speculative=False,
    compiled=False,
)


def test_auto_takes_piecewise_graphs_only_where_they_are_tested() -> None:
    assert auto_graph_mode(**PLAIN) == ("full_and_piecewise", "an unquantized model on one GPU")
    fp8 = {**PLAIN, "quantized": True, "fp8_at_load": True}
    assert auto_graph_mode(**fp8) == (
        "full_and_piecewise",
        "FP8 weights quantized at load on one GPU",
    )
    flips = {"cuda": False, "triton": False}
    for base in (PLAIN, fp8):
        for name in PLAIN:
            if name == "fp8_at_load" or (name == "quantized" and base is fp8):
                continue  # says which quantization, when there is one; fp8's is already on
            mode, why = auto_graph_mode(**{**base, name: flips.get(name, True)})
            assert mode == "full_decode_only", (name, base)
            assert why.startswith("piecewise graphs are not tested with "), why
    _, why = auto_graph_mode(**{**PLAIN, "quantized": True, "speculative": True})
    assert why.endswith("a checkpoint's quantized weights, speculative decoding")
    _, why = auto_graph_mode(**{**fp8, "kv_quantized": True})
    assert why == "piecewise graphs are not tested with a quantized KV cache"


def test_auto_on_cpu_runs_as_the_default(llama_ckpt: Path) -> None:
    """``auto`` on CPU resolves to whole-model decode graphs (none captured there)."""
    llm = LLM(str(llama_ckpt), cuda_graph_mode="auto", **STRESS)
    w = llm.engine.worker
    assert w.cuda_graph_mode == "full_decode_only" and w.piecewise is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cuda_graph_mode": "full"}, "cuda_graph_mode must be one of"),
        ({"piecewise_capture_sizes": "8,x"}, "'x' is not a positive integer"),
        ({"piecewise_capture_sizes": "0,8"}, "'0' is not a positive integer"),
        ({"piecewise_capture_sizes": "9000"}, "9000 is larger than max_num_batched_tokens"),
        ({"piecewise_compile_sizes": "12"}, "12 are not captured sizes"),
        (
            {"piecewise_compile_sizes": "16", "piecewise_compiler": "eager"},
            "needs piecewise_compiler='inductor'",
        ),
        ({"piecewise_compiler": "aot"}, "piecewise_compiler must be one of"),
        ({"piecewise_split_ops": "attention"}, "is not a custom op name"),
        ({"piecewise_max_tokens": 0}, "piecewise_max_tokens must be >= 1"),
        (
            {"enforce_eager": True, "cuda_graph_mode": "full_and_piecewise"},
            "contradicts cuda_graph_mode='full_and_piecewise'",
        ),
    ],
)
def test_bad_compilation_settings_are_refused_with_the_reason(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **kwargs)


# ---- the split -------------------------------------------------------------------------
def _linears(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and "linear" in str(n.target) for n in gm.graph.nodes)


def test_graph_splits_at_each_attention_op(llama_ckpt: Path) -> None:
    """2 layers: [embed, norm, qkv, rope] attn [o_proj, add+norm, mlp, add+norm, qkv,
    rope] attn [o_proj, add+norm, mlp, final norm]; each attention alone in its item."""
    llm = LLM(str(llama_ckpt), **PIECEWISE, **STRESS)
    pw = llm.engine.worker.piecewise
    assert pw is not None and llm.engine.worker.graphs is None  # no decode graphs on CPU
    items = pw.compile_backend.items
    assert [it.is_split_op for it in items] == [False, True, False, True, False]
    for it in items:
        ops = [op_target_name(n) for n in it.module.graph.nodes]
        attn = ops.count("kvscale.paged_attention")
        assert attn == (1 if it.is_split_op else 0)
        if it.is_split_op:  # nothing else runs eagerly, and not through the dispatcher
            assert sum(n.op == "call_function" for n in it.module.graph.nodes) == 1
            runs = pw.compile_backend.split_gm.__dict__[it.name]
            assert runs.__qualname__ == "direct_call.<locals>.run"
    first, middle, last = (items[i].module for i in (0, 2, 4))
    assert [_linears(first), _linears(middle), _linears(last)] == [1, 4, 3]
    targets = [[str(n.target) for n in gm.graph.nodes] for gm in (first, middle, last)]
    assert any("embedding" in t for t in targets[0])
    assert not any("embedding" in t for t in targets[1] + targets[2])
    # the attention output buffer is allocated by the piece before the op
    assert all(any("zeros_like" in t for t in ts) for ts in targets[:2])
    assert len(pw.compile_backend.pieces) == 3


# ---- padding ---------------------------------------------------------------------------
def _step(worker: Worker, seqs: list[tuple[list[int], int, int, list[int]]]) -> StepInput:
    """A step from ``(token ids, start, new tokens, block table)`` per sequence, each
    sampling its last new token greedily."""
    bs = worker.block_size
    ids, pos, slots, q_start, lens, sample = [], [], [], [0], [], []
    width = max(len(t) for *_, t in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, (toks, start, n, table) in enumerate(seqs):
        p = np.arange(start, start + n)
        ids += toks[start : start + n]
        pos += p.tolist()
        slots += (np.asarray(table)[p // bs] * bs + p % bs).tolist()
        q_start.append(q_start[-1] + n)
        lens.append(start + n)
        tables[i, : len(table)] = table
        sample.append(q_start[-1] - 1)
    arrays = {
        "ids": np.array(ids, dtype=np.int64),
        "positions": np.array(pos, dtype=np.int64),
        "slots": np.array(slots, dtype=np.int64),
        "seq_lens": np.array(lens, dtype=np.int32),
        "q_start": np.array(q_start, dtype=np.int32),
        "tables": tables,
        "logits_idx": np.array(sample, dtype=np.int64),
        "sampling": np.tile(np.array([1, 0, 1, 0, 1, 1, 0, 0], np.float32), (len(seqs), 1)),
    }
    plan = SamplingPlan([None] * len(seqs), [None] * len(seqs), all_greedy=True)
    return StepInput(arrays, len(seqs), max(n for _, _, n, _ in seqs), max(lens), 0, plan)


def test_padded_rows_change_no_output(llama_ckpt: Path) -> None:
    """A mixed step (a decode, a prefill chunk after cached context, a new prompt) run
    eagerly and padded to two buckets over garbage in the padding rows: the same logits,
    and the padding writes no KV-cache slot."""
    from kvscale.server.worker.host_to_device import to_device

    llm = LLM(
        str(llama_ckpt),
        cuda_graph_mode="piecewise",
        piecewise_compiler="eager",
        piecewise_capture_sizes="16,64",
        device="cpu",
        num_kv_blocks=32,
        block_size=8,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=96,
    )
    w = llm.engine.worker
    assert w.piecewise is not None
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (10, 9, 6))
    for layer in w.kv_pool.layers:
        layer.k.zero_()
        layer.v.zero_()
    with torch.inference_mode():
        # context: a's first 9 tokens (blocks 0, 1) and b's first 3 (block 2)
        first = _step(w, [(a, 0, 9, [0, 1]), (b, 0, 3, [2])])
        w._forward_eager(first, to_device(first.arrays, w.device))
        before = [(x.k.clone(), x.v.clone()) for x in w.kv_pool.layers]
        mixed = _step(w, [(a, 9, 1, [0, 1]), (b, 3, 6, [2, 4]), (c, 0, 6, [5])])
        assert mixed.num_tokens == 13 and mixed.max_query_len == 6

        def run(bucket: int | None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
            for (k, v), layer in zip(before, w.kv_pool.layers, strict=True):
                layer.k.copy_(k)
                layer.v.copy_(v)
            dev = to_device(mixed.arrays, w.device)
            if bucket is None:
                logits = w._forward_eager(mixed, dev)
            else:  # garbage (valid ids and positions) in the rows past the step's 13
                pw = w.piecewise
                assert pw is not None
                pw.input_ids[13:].random_(3, 32000, generator=gen)
                pw.positions[13:].random_(0, 96, generator=gen)
                logits = pw.run(mixed, dev, bucket)
            return logits.clone(), [(x.k.clone(), x.v.clone()) for x in w.kv_pool.layers]

        ref, kv_ref = run(None)
        for bucket in (16, 64):
            logits, kv = run(bucket)
            torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
            assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()
            for (k, v), (k_ref, v_ref), (k0, v0) in zip(kv, kv_ref, before, strict=True):
                torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-5)
                # blocks 3 and 6.. were never written, by real rows or padding
                assert torch.equal(k[6:], k0[6:]) and torch.equal(k[3], k0[3])
                assert torch.equal(v[6:], v0[6:]) and torch.equal(v[3], v0[3])


# ---- compiled pieces against eager -------------------------------------------------------
class _Recorder:
    """Wraps a worker's dispatcher and counts the kinds of steps it dispatched."""

    def __init__(self, inner: GraphDispatcher) -> None:
        self.inner = inner
        self.kinds: list[str] = []

    def decode_size(self, num_seqs: int) -> int:
        return self.inner.decode_size(num_seqs)

    def dispatch(self, num_tokens: int, decode_graph_size: int = 0) -> Dispatch:
        d = self.inner.dispatch(num_tokens, decode_graph_size)
        self.kinds.append(d.kind)
        return d


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def ckpt3(checkpoint_factory: Callable[..., Path]) -> Path:
    """Three layers, so that two middle pieces are identical."""
    return checkpoint_factory("llama-3-layers", arch="llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def eager_tokens(ckpt3: Path) -> list[list[int]]:
    llm = LLM(str(ckpt3), **STRESS)
    assert llm.engine.worker.piecewise is None
    tokens = _tokens(llm)
    assert llm.engine.stats().num_preemptions > 0
    return tokens


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="module")
def inductor_llm(ckpt3: Path, cache_dir: Path) -> Iterator[LLM]:
    yield LLM(str(ckpt3), compile_cache_dir=str(cache_dir), **INDUCTOR, **PIECEWISE, **STRESS)


def test_inductor_pieces_match_eager_with_chunked_prefill_and_preemption(
    inductor_llm: LLM, eager_tokens: list[list[int]]
) -> None:
    w = inductor_llm.engine.worker
    assert w.piecewise is not None
    stats = w.piecewise.compile_backend.compiler.stats
    # first piece, two identical middle pieces (compiled once), last piece
    assert len(w.piecewise.compile_backend.pieces) == 4
    assert (stats.compiled + stats.loaded, stats.reused) == (3, 1)
    recorder = _Recorder(w.dispatcher)
    w.dispatcher = recorder  # type: ignore[assignment]
    try:
        got = _tokens(inductor_llm)
    finally:
        w.dispatcher = recorder.inner
    assert inductor_llm.engine.stats().num_preemptions > 0
    assert {"piecewise", "eager"} <= set(recorder.kinds)  # mixed steps and larger ones
    assert got == eager_tokens


def test_dynamic_shape_pieces_serve_any_token_count(inductor_llm: LLM) -> None:
    """The one traced graph (compiled for >= 2 tokens, guards dropped) runs 1 and 37
    tokens, outside every bucket, as the uncompiled model does: what whole-model decode
    graphs and eager steps get with --compile."""
    from kvscale.server.attention.forward_context import forward_context
    from kvscale.server.compilation.runtime import piece_run

    w = inductor_llm.engine.worker
    pw = w.piecewise
    assert pw is not None
    for n in (1, 37):
        ids = torch.randint(3, 32000, (n,))
        pos = torch.arange(n)
        with torch.inference_mode():
            with forward_context(w.backend, pw._dummy_meta(n)):
                ref = w.model.model(ids, pos).clone()
            with piece_run(None), forward_context(w.backend, pw._dummy_meta(n)):
                got = pw.compiled(ids, pos)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_compiled_pieces_load_from_the_disk_cache(
    ckpt3: Path, cache_dir: Path, inductor_llm: LLM, eager_tokens: list[list[int]]
) -> None:
    """A second start finds the dynamic-shape pieces on disk; static-shape pieces of a
    compile size are compiled once more (first, middle, last) and used for that bucket."""
    assert list((cache_dir / "pieces").glob("*.bin"))
    llm = LLM(
        str(ckpt3),
        compile_cache_dir=str(cache_dir),
        piecewise_compile_sizes="16",
        **INDUCTOR,
        **PIECEWISE,
        **STRESS,
    )
    w = llm.engine.worker
    assert w.piecewise is not None
    compiler = w.piecewise.compile_backend.compiler
    assert compiler.stats.loaded == 3
    assert (compiler.stats.compiled, compiler.stats.reused) == (3, 2)  # static size 16
    assert {shape for shape, _, _ in compiler.by_index} == {None, 16}
    assert _tokens(llm) == eager_tokens


class _ReplayingGraph:
    """A CPU stand-in for a CUDA graph: it keeps what was captured (the call and its
    inputs, whose addresses a graph fixes) and on replay runs it again, writing into the
    captured outputs. Steps replayed through it read only what the capture saw: the
    static input buffers, the earlier pieces' outputs, the attention output buffers."""

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None
        self.out: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None
        _copy_into(self.out, self.fn())


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, tuple | list):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)


def test_steps_replayed_from_fixed_inputs_match_eager(
    ckpt3: Path, tmp_path: Path, eager_tokens: list[list[int]]
) -> None:
    """Capture and replay emulated on CPU: every bucket captured (largest first), then
    every mixed step replays pieces that read only what their capture saw, with the
    debug check that inputs never moved. Also the eager piece compiler, and --compile
    routing the steps above the buckets through the same compiled model."""
    llm = LLM(
        str(ckpt3),
        piecewise_compiler="eager",
        compile=True,
        compile_debug=True,
        compile_cache_dir=str(tmp_path),
        **PIECEWISE,
        **STRESS,
    )
    w = llm.engine.worker
    pw = w.piecewise
    assert pw is not None and not pw.use_graphs and w.model.model is pw.compiled
    assert (tmp_path / "split_graph.py").is_file()
    pieces = pw.compile_backend.pieces
    for piece in pieces:
        piece.graph_factory = _ReplayingGraph
    pw.use_graphs = True
    with torch.inference_mode():
        pw.capture_all()
    assert all(p.captured_sizes == [8, 16, 32] for p in pieces)
    replays = 0
    replay = _ReplayingGraph.replay

    def counted(self: _ReplayingGraph) -> None:
        nonlocal replays
        replays += 1
        replay(self)

    _ReplayingGraph.replay = counted  # type: ignore[method-assign]
    try:
        assert _tokens(llm) == eager_tokens
    finally:
        _ReplayingGraph.replay = replay  # type: ignore[method-assign]
    assert replays > 0 and replays % len(pieces) == 0
    # the engine stopping (a tensor-parallel worker, before it leaves its process group):
    # no graph is left, and a later step runs eagerly with the same tokens
    w.release_graphs()
    assert all(p.captured_sizes == [] for p in pieces)
    assert w.dispatcher.dispatch(16) == Dispatch("eager", 0)
    assert _tokens(llm) == eager_tokens


def test_modes_without_piecewise_graphs_build_none(llama_ckpt: Path) -> None:
    for mode in ("full_decode_only", "none"):
        llm = LLM(str(llama_ckpt), cuda_graph_mode=mode, **STRESS)
        w = llm.engine.worker
        assert w.piecewise is None and w.graphs is None  # and no decode graphs on CPU
        assert w.dispatcher.dispatch(16) == Dispatch("eager", 0)


def test_a_model_that_cannot_be_split_runs_without_piecewise_graphs(
    llama_ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No split op in the traced graph (attention would be captured): a warning with the
    reason, and the engine serves as without piecewise graphs."""
    with caplog.at_level("WARNING", logger="kvscale.server.worker.worker"):
        llm = LLM(
            str(llama_ckpt),
            piecewise_compiler="eager",
            piecewise_split_ops="kvscale::no_such_op",
            **PIECEWISE,
            **STRESS,
        )
    w = llm.engine.worker
    assert w.piecewise is None and w.dispatcher.dispatch(16) == Dispatch("eager", 0)
    assert "piecewise CUDA graphs are off" in caplog.text
    assert "no split op (kvscale::no_such_op) was found" in caplog.text
    assert all(len(t) == 8 for t in _tokens(llm, PROMPTS[:3]))


# ---- Dynamo state shared within a process ------------------------------------------------
def test_a_forward_that_dynamo_does_not_compile_turns_piecewise_off(
    llama_ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Dynamo may run the compiled forward eagerly without calling the backend (torch
    2.11 does so silently once the forward's code hit its recompile limit; the
    force_eager stance does so everywhere): piecewise graphs are then off, with the
    reason, instead of padded buckets running through the uncompiled model, whose
    attention takes the real tokens only."""
    eager = _tokens(LLM(str(llama_ckpt), **STRESS), PROMPTS[:4])
    with torch.compiler.set_stance("force_eager"):
        with caplog.at_level("WARNING", logger="kvscale.server.worker.worker"):
            llm = LLM(str(llama_ckpt), piecewise_compiler="eager", **PIECEWISE, **STRESS)
        assert _tokens(llm, PROMPTS[:4]) == eager
    assert llm.engine.worker.piecewise is None
    assert "the piecewise backend was never called" in caplog.text


def test_engines_in_one_process_compile_pieces_of_their_own(llama_ckpt: Path) -> None:
    """Each engine compiles a forward of its own code object, so that engines built one
    after another (the GPU tests build a dozen) neither find each other's guard-free
    graph nor use up Dynamo's recompile limit for the model class's forward."""
    import torch._dynamo

    eager = _tokens(LLM(str(llama_ckpt), **STRESS), PROMPTS[:4])
    codes = []
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(2):
            llm = LLM(str(llama_ckpt), piecewise_compiler="eager", **PIECEWISE, **STRESS)
            pw = llm.engine.worker.piecewise
            assert pw is not None and len(pw.compile_backend.pieces) == 3
            codes.append(llm.engine.worker.model.model.forward.__code__)
            recorder = _Recorder(llm.engine.worker.dispatcher)
            llm.engine.worker.dispatcher = recorder  # type: ignore[assignment]
            assert _tokens(llm, PROMPTS[:4]) == eager
            assert "piecewise" in recorder.kinds
    assert codes[0] is not codes[1]


def test_a_closed_piecewise_engine_frees_its_model(llama_ckpt: Path) -> None:
    """After shutdown and the last reference, the weights are garbage: nothing (Dynamo's
    cache on the engine's own forward code, the compiled pieces) keeps the model alive,
    so a process can build the next engine (on a GPU: in the memory this one held)."""
    import gc
    import weakref

    llm = LLM(str(llama_ckpt), **PIECEWISE, **STRESS)
    assert llm.engine.worker.piecewise is not None
    _tokens(llm, PROMPTS[:2])
    weights = weakref.ref(llm.engine.worker.model.model.embed_tokens.weight)
    llm.engine.core.shutdown()
    del llm
    gc.collect()
    assert weights() is None
