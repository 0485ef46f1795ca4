"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs): run on a machine with two GPUs.

    pytest -q tests/gpu/test_tensor_parallel_cuda.py

- TP=2 greedy tokens equal TP=1's in fp32 (Triton kernels, decode CUDA graphs on) for
  Llama (2 KV heads split, 1 KV head replicated, odd vocabulary) and Qwen2, under forced
  chunked prefill and preemption; decode steps really replay graphs; the shutdown then
  leaves the process group within 5 s (the graphs dropped first).
- With the one-shot all-reduce (a process of its own: only a process's first TP engine
  sets it up), TP=2 greedy tokens equal TP=1's in fp32.
- Speculative decoding at TP=2 (n-gram, an in-process draft) gives TP=1's greedy tokens.
- The decode graphs hold the all-reduces: a graph-replay step launches no all-reduce
  from the host (only the token broadcast), and graphs give eager's tokens up to near
  ties (fp32).
- bf16 TP=2 tracks TP=1 as closely as bf16 tracks fp32; with TP=2, prefix caching gives
  the uncached tokens up to near ties and FP8 (at load) stays within FP8's own error.
- A rank killed (SIGKILL) or stopped (SIGSTOP, caught by --watchdog-timeout) mid-stream
  makes ``kvscale serve`` fail the stream and exit non-zero with the reason, in bounded
  time (NCCL never errors on a lost peer: this is the monitor's path).

Every process the engine starts runs with NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (the engine forces them).
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from kvscale.server.distributed.group import NCCL_ENV
from tests.greedy_paths import mean_common_prefix
from tests.hf_reference import (
    assert_greedy_agrees_up_to_near_ties,
    fp8_tp2_and_quantization_gaps,
    random_prompts,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

ODD_VOCAB = 31999
PROMPTS = [[t % ODD_VOCAB for t in p] for p in random_prompts(16, (2, 90), seed=1)]
STRESS = dict(
    max_num_batched_tokens=32, max_num_seqs=16, num_kv_blocks=16, block_size=16, max_model_len=128
)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
# A fixed KV pool for tests that build engines one after another: one sized from free
# memory counts an earlier engine not yet collected against the next.
FIXED_POOL = dict(num_kv_blocks=256)
ARCHES: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", seed=4),
    "llama-mqa-odd-vocab": dict(arch="llama", seed=5, num_key_value_heads=1, vocab_size=ODD_VOCAB),
    "qwen2-odd-vocab": dict(arch="qwen2", seed=6, vocab_size=ODD_VOCAB),
}


@pytest.fixture(autouse=True)
def _release_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _free(llm: LLM) -> float:
    """Shuts the engine down; returns the seconds that took."""
    start = time.monotonic()
    llm.engine.core.shutdown()  # stops rank 1, leaves the process group (TP=1: nothing)
    seconds = time.monotonic() - start
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def _run(path: Path, prompts: list[list[int]] = PROMPTS, params: SamplingParams = GREEDY,
         **kw: Any) -> list[list[int]]:  # fmt: skip
    """The greedy tokens of an engine that is gone (its ranks stopped, its GPU memory
    released) on return: the next engine, if it sizes its KV pool from free memory, must
    not count this one's pool against it (a caller's reference would keep it alive)."""
    return [c.token_ids for c in _outputs(path, prompts, params, **kw)]


def _outputs(path: Path, prompts: list[list[int]], params: SamplingParams, **kw: Any) -> list[Any]:
    """``_run``'s engine, returning each prompt's ``CompletionOutput`` (logprobs too)."""
    llm = LLM(str(path), device="cuda", **kw)
    try:
        outs = llm.generate(prompts, params)
    finally:
        _free(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0] for o in outs]


def _count_replays(llm: LLM) -> dict[str, int]:
    """Counts rank 0's decode-graph replays from now on."""
    graphs = llm.engine.worker.worker.graphs
    assert graphs is not None, "decode CUDA graphs are off"
    count = {"replays": 0}
    run = graphs.run

    def counted(*a: Any) -> Any:
        count["replays"] += 1
        return run(*a)

    graphs.run = counted  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("arch", list(ARCHES))
def test_tp2_fp32_greedy_equals_tp1_with_cuda_graphs(
    checkpoint_factory: Callable[..., Path], arch: str
) -> None:
    path = checkpoint_factory(f"gpu-tp-{arch}", **ARCHES[arch])
    ref = _run(path, dtype="float32", **STRESS)
    llm = LLM(str(path), device="cuda", dtype="float32", tensor_parallel_size=2, **STRESS)
    try:
        replays = _count_replays(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert replays["replays"] > 0
        assert llm.engine.stats().num_preemptions > 0
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        shutdown_s = _free(llm)
    bad = [i for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r]
    assert not bad, f"prompts {bad} differ: {got[bad[0]]} vs {ref[bad[0]]}"
    # the graphs dropped first, NCCL's teardown does not wait out leave_group's 10 s
    assert not torch.distributed.is_initialized() and shutdown_s < 5, shutdown_s
    for key, value in NCCL_ENV.items():  # the engine set them before NCCL started
        assert os.environ[key] == value


def _one_shot_tokens(rank: int, path: str, q: Any) -> None:
    """In a process of its own (only a process's first TP engine sets up the one-shot
    all-reduce): TP=2 greedy tokens, and whether the one-shot path was on."""
    try:
        llm = LLM(path, device="cuda", dtype="float32", tensor_parallel_size=2, **STRESS)
        on = llm.engine.worker.worker.parallel.one_shot is not None
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.engine.core.shutdown()
        q.put((rank, (on, tokens)))
    except BaseException as e:
        q.put((rank, (f"{type(e).__name__}: {e}", None)))


def test_tp2_with_the_one_shot_all_reduce_equals_tp1(
    checkpoint_factory: Callable[..., Path],
) -> None:
    """Every sum of up to ``MAX_ROWS`` rows (decode steps and the 32-token prefill
    chunks) in the one-shot kernel, fused with the add and norm: the greedy tokens stay
    TP=1's."""
    from tests.spawned_ranks import run_ranks

    path = checkpoint_factory("gpu-tp-llama", **ARCHES["llama"])
    ref = _run(path, dtype="float32", **STRESS)
    on, got = run_ranks(_one_shot_tokens, 1, (str(path),), timeout_s=600)[0]
    assert on is True, on
    bad = [i for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r]
    assert not bad, f"prompts {bad} differ: {got[bad[0]]} vs {ref[bad[0]]}"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_tp2_with_speculation_equals_tp1(
    checkpoint_factory: Callable[..., Path], method: str
) -> None:
    """Speculative steps at TP=2 (rank 0 drafts, the verify forward on both ranks, graphs
    on): greedy fp32 tokens equal TP=1's without speculation, under chunked prefill and
    preemption; the target as its own in-process draft has every draft accepted."""
    path = checkpoint_factory("gpu-tp-llama", **ARCHES["llama"])
    prompts = [p[:40] * 2 for p in PROMPTS]  # each repeats itself: n-gram lookups match
    ref = _run(path, prompts, dtype="float32", **STRESS)
    spec: dict[str, Any] = dict(speculative_method=method, num_speculative_tokens=3)
    if method == "ngram":
        spec.update(ngram_min=1, ngram_max=3)
    else:
        spec.update(speculative_model=str(path))
    llm = LLM(str(path), device="cuda", dtype="float32", tensor_parallel_size=2, **STRESS, **spec)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.engine.stats()
    finally:
        _free(llm)
    bad = [i for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r]
    assert not bad, f"prompts {bad} differ: {got[bad[0]]} vs {ref[bad[0]]}"
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 0
    if method == "draft":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_decode_graphs_hold_the_all_reduces(checkpoint_factory: Callable[..., Path]) -> None:
    from torch.profiler import ProfilerActivity, profile

    path = checkpoint_factory("gpu-tp-llama", **ARCHES["llama"])
    kw: dict[str, Any] = dict(dtype="float32", tensor_parallel_size=2, **FIXED_POOL)
    eager = _outputs(path, PROMPTS, GREEDY_LOGPROBS, enforce_eager=True, **kw)
    llm = LLM(str(path), device="cuda", **kw)
    try:
        graphs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        # Same kernels; NCCL may order a captured all-reduce's sums differently.
        assert_greedy_agrees_up_to_near_ties(eager, graphs, atol=1e-3, max_diverged=2)
        eng = llm.engine
        eng.add_request("d", PROMPTS[0], SamplingParams(temperature=0, max_tokens=40))
        for _ in range(4):  # prefill, then decode steps only
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eng.step()
            torch.cuda.synchronize()
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        _free(llm)
    from torch.autograd import DeviceType

    cpu = " ".join(e.name for e in prof.events() if e.device_type == DeviceType.CPU)
    assert "cudaGraphLaunch" in cpu
    # every all-reduce of the forward is inside the graph: none is launched from the host
    assert "all_reduce" not in cpu and "allreduce" not in cpu
    assert "broadcast" in cpu  # rank 0's sampled tokens, eagerly, once a step


def test_tp2_bf16_tracks_tp1_as_bf16_tracks_fp32(checkpoint_factory: Callable[..., Path]) -> None:
    path = checkpoint_factory("gpu-tp-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    runs = {}
    for name, kw in {
        "fp32": dict(dtype="float32"),
        "tp1": dict(dtype="bfloat16"),
        "tp2": dict(dtype="bfloat16", tensor_parallel_size=2),
    }.items():
        runs[name] = _run(path, **kw, **STRESS)
    tp2_vs_tp1 = mean_common_prefix(runs["tp2"], runs["tp1"])
    bf16_vs_fp32 = mean_common_prefix(runs["tp1"], runs["fp32"])
    print(f"bf16 common prefix: TP=2 vs TP=1 {tp2_vs_tp1:.1f}, bf16 vs fp32 {bf16_vs_fp32:.1f}")
    assert tp2_vs_tp1 >= 0.8 * bf16_vs_fp32


def test_tp2_prefix_caching_gives_the_uncached_tokens(
    checkpoint_factory: Callable[..., Path],
) -> None:
    path = checkpoint_factory("gpu-tp-llama", **ARCHES["llama"])
    system = PROMPTS[0] * 3  # a shared prefix of several 16-token blocks
    prompts = [system + p[1:] for p in PROMPTS[:8]]
    kw = dict(dtype="float32", tensor_parallel_size=2, max_model_len=512, **FIXED_POOL)
    off = _outputs(path, prompts, GREEDY_LOGPROBS, enable_prefix_caching=False, **kw)
    llm = LLM(str(path), device="cuda", enable_prefix_caching=True, **kw)
    try:
        on = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.engine.stats()
    finally:
        _free(llm)
    assert stats.prefix_cache_hits > 0
    # Cached prompts are prefilled from the first uncached block: other chunks, other sums.
    assert_greedy_agrees_up_to_near_ties(off, on, atol=1e-3, max_diverged=2)


def test_tp2_fp8_at_load_tracks_tp1(checkpoint_factory: Callable[..., Path]) -> None:
    """FP8 TP=2 is as close to FP8 TP=1 as FP8 is to bf16 (tests/hf_reference.py says why
    they differ at all); the CPU test checks the same over gloo."""
    path = checkpoint_factory("gpu-tp-llama-bf16", arch="llama", seed=4, dtype="bfloat16")
    tp_gap, quant_gap = fp8_tp2_and_quantization_gaps(path, PROMPTS, device="cuda", **FIXED_POOL)
    print(f"prompt-logprob gap: FP8 TP=2 vs TP=1 {tp_gap:.4f}, FP8 vs bf16 {quant_gap:.4f}")
    assert tp_gap <= quant_gap


# ---- failures: the server exits non-zero with the reason ---------------------------------
def _stream_until_failure(server: Any, pid: int, sig: int) -> tuple[list[dict], float]:
    import httpx

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    events: list[dict] = []
    t_sig = 0.0
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 3:
                os.kill(pid, sig)
                t_sig = time.monotonic()
    return events, t_sig


@pytest.mark.parametrize(
    ("sig", "reason", "extra"),
    [
        (signal.SIGKILL, "was killed by signal SIGKILL", []),
        (signal.SIGSTOP, "is stopped", ["--watchdog-timeout", "10"]),
    ],
)
def test_a_failed_rank_makes_the_server_exit_nonzero(
    tmp_path: Path,
    checkpoint_factory: Callable[..., Path],
    sig: int,
    reason: str,
    extra: list[str],
) -> None:
    from tests.server.conftest import ServerProcess

    path = checkpoint_factory("gpu-tp-llama", **ARCHES["llama"])
    server = ServerProcess(path, ["--device", "cuda", "--tensor-parallel-size", "2", *extra],
                           tmp_path / "server.log")  # fmt: skip
    try:
        server.wait_ready(timeout=300)
        found = re.search(r"tensor-parallel rank 1 started: pid (\d+)", server.log())
        assert found, server.log()
        pid = int(found.group(1))
        events, t_sig = _stream_until_failure(server, pid, sig)
        assert f"rank 1 (pid {pid}) {reason}" in events[-1]["error"]["message"], events[-1]
        code = server.wait_exit(timeout=60)
        waited = time.monotonic() - t_sig
        assert code != 0
        assert f"rank 1 (pid {pid}) {reason}" in server.log()
        print(f"{signal.Signals(sig).name}: the server exited {code} after {waited:.1f}s")
        assert waited < (10 + 30 if sig == signal.SIGSTOP else 30)
    finally:
        server.stop()
