"""Speculative decoding on CUDA (GPU machine only): greedy with drafts token-identical to
greedy without (fp32, Triton kernels, CUDA graphs for decode steps and for verify steps
laid out one row per token), under chunked prefill and preemption; the echo model
accepts every draft."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvscale.server import LLM, SamplingParams
from tests.draft_helpers import perturbed_copy
from tests.hf_reference import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [p + p[: len(p) // 2] for p in random_prompts(16, (2, 60), seed=3)]
STRESS = dict(
    max_num_batched_tokens=32, max_num_seqs=16, num_kv_blocks=24, block_size=16, max_model_len=160
)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# 16 prompts: past the default batch size at which speculation pauses
NGRAM = dict(
    speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3,
    speculative_disable_by_batch_size=64,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _release_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _tokens(path: Path, on_device: bool = True, **kw: object) -> tuple[list[list[int]], object]:
    llm = LLM(str(path), device="cuda", dtype="float32", **kw)
    if llm.engine.core.speculator is not None:
        llm.engine.core.speculator.on_device &= on_device
    worker = llm.engine.worker
    assert worker.graphs is not None  # decode graphs run the steps without drafts
    forward, replayed_verify = worker.forward, []

    def spy(step):  # verify steps that fit a decode graph replay it, one row per token
        if step.sampling.spec_k and step.graph_size:
            replayed_verify.append(step.num_seqs)
        return forward(step)

    worker.forward = spy
    spec = llm.engine.core.speculator
    if spec is not None and spec.proposer.name == "ngram":  # on a GPU: its device lookup
        assert type(spec.proposer).__name__ == "DeviceNgramProposer"
    outs = llm.generate(PROMPTS, GREEDY)
    stats = llm.engine.stats()
    # drafts served from the verify steps' follow-up on the GPU
    stats.ngram_ready_hits = getattr(spec.proposer, "ready_hits", 0) if spec else 0
    llm.engine.core.shutdown()
    if stats.spec_num_drafts:
        assert replayed_verify, "no verify step replayed a decode graph"
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("model", ["random", "echo"])
@pytest.mark.parametrize("mode", ["default", "stress"])
def test_ngram_greedy_identical_on_cuda(
    llama_ckpt: Path, echo_ckpt: Path, model: str, mode: str
) -> None:
    path = llama_ckpt if model == "random" else echo_ckpt
    kw = STRESS if mode == "stress" else dict(num_kv_blocks=512)
    ref, _ = _tokens(path, **kw)
    got, stats = _tokens(path, **kw, **NGRAM)
    assert got == ref
    if mode == "stress":
        assert stats.num_preemptions > 0
    if model == "echo":
        # the echo model repeats its last token for nearly every token (an embedding's
        # dot product with itself is nearly always the largest): nearly every draft holds
        assert stats.spec_num_drafts > 0
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
        assert stats.ngram_ready_hits > 0.5 * stats.spec_num_drafts


@pytest.mark.parametrize("on_device", [True, False])
def test_inprocess_draft_greedy_identical_on_cuda(
    llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory, on_device: bool
) -> None:
    """The draft model in process, agreeing only sometimes: greedy tokens identical to no
    speculation, under chunked prefill and preemption, with its drafts left on the GPU
    for the verify step (the default) and read on the host alike."""
    draft = perturbed_copy(llama_ckpt, tmp_path_factory.mktemp("noisy") / "draft", 0.2)
    ref, _ = _tokens(llama_ckpt, **STRESS)
    spec = dict(speculative_method="draft", speculative_model=str(draft), num_speculative_tokens=3)
    got, stats = _tokens(
        llama_ckpt, **STRESS, **spec, speculative_disable_by_batch_size=64, on_device=on_device
    )
    assert got == ref
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_device_ngram_proposals_for_256_sequences() -> None:
    """The issue's measure: n-gram proposals for 256 sequences of 500-2048 tokens, each
    grown by 1-5 accepted tokens before every call (as the host proposer's test): the
    device proposer's whole call (new tokens to the GPU, the match, drafts back), printed
    beside the host proposer's on the same workload, same drafts; then the match kernel
    alone and a batch of one."""
    import statistics
    import time

    import numpy as np

    from kvscale.kernels.ngram_match import ngram_match, pack_inputs
    from kvscale.server.spec_decode.ngram_device import DeviceNgramProposer
    from kvscale.server.spec_decode.ngram_proposer import NgramProposer
    from kvscale.server.spec_decode.proposer import DraftRequest

    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 200, size=int(rng.integers(500, 2048))).tolist() for _ in range(256)]
    host = NgramProposer(k=4, min_n=2, max_n=4)
    dev = DeviceNgramProposer(4, 2, 4, torch.device("cuda"))
    reqs = [DraftRequest(i, s, 4) for i, s in enumerate(seqs)]
    spent: dict[str, list[float]] = {"host": [], "device": []}
    for step in range(53):
        for s in seqs:
            s.extend(rng.integers(0, 200, size=int(rng.integers(1, 6))).tolist())
        outs = []
        for name, p in (("host", host), ("device", dev)):
            t0 = time.perf_counter()
            outs.append(p.propose(reqs))
            if step >= 3:  # the first calls index / copy the prompts
                spent[name].append(time.perf_counter() - t0)
        assert outs[0].tokens.tolist() == outs[1].tokens.tolist()
    med = {n: statistics.median(v) * 1e3 for n, v in spent.items()}
    worst = {n: max(v) * 1e3 for n, v in spent.items()}
    hist = dev._hist
    lengths = np.array([len(s) for s in seqs])
    packed = torch.from_numpy(pack_inputs(np.arange(256), lengths)).cuda()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ngram_match(hist, packed, 256, 4, 2, 4)
    start.record()
    for _ in range(100):
        ngram_match(hist, packed, 256, 4, 2, 4)
    end.record()
    end.synchronize()
    kernel_us = start.elapsed_time(end) * 10
    one = [DraftRequest(1000, seqs[0][:700], 4)]
    dev.propose(one)
    t0 = time.perf_counter()
    for _ in range(50):
        one[0].token_ids.append(int(rng.integers(0, 200)))  # type: ignore[attr-defined]
        dev.propose(one)
    one_ms = (time.perf_counter() - t0) / 50 * 1e3
    print(
        f"\nn-gram proposals, 256 sequences of 500-2048 tokens, a step (median, worst of 50): "
        f"device {med['device']:.3f} ms ({worst['device']:.3f}), host {med['host']:.3f} ms "
        f"({worst['host']:.3f}), same drafts; the match kernel alone {kernel_us:.1f} us "
        f"(launches back to back); the device proposer for one sequence {one_ms:.3f} ms"
    )
    assert med["device"] < med["host"]


def test_verify_follow_up_for_256_sequences() -> None:
    """The n-gram drafts made right after a verify step, for 256 sequences of 500-2048
    tokens with 1-5 emitted tokens each: the host's part (staging the rows, queueing the
    kernel, then the next ``propose`` finding the drafts ready) and the kernel's GPU time,
    printed; the drafts equal the host proposer's."""
    import statistics
    import time

    import numpy as np

    from kvscale.server.spec_decode.ngram_device import DeviceNgramProposer
    from kvscale.server.spec_decode.ngram_proposer import NgramProposer
    from kvscale.server.spec_decode.proposer import DraftRequest

    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 200, size=int(rng.integers(500, 2048))).tolist() for _ in range(256)]
    host = NgramProposer(k=4, min_n=2, max_n=4)
    dev = DeviceNgramProposer(4, 2, 4, torch.device("cuda"))
    reqs = [DraftRequest(i, s, 4) for i, s in enumerate(seqs)]
    dev.propose(reqs)
    ids = list(range(256))
    host_ms, propose_ms, gpu_us = [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(53):
        acc = rng.integers(0, 5, size=256)
        emitted = rng.integers(0, 200, size=(256, 5))
        tokens, accepted = torch.from_numpy(emitted).cuda(), torch.from_numpy(acc).cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.stage_verify(ids)
        start.record()
        dev.after_verify(tokens, accepted)
        end.record()
        t1 = time.perf_counter()
        end.synchronize()  # the engine reads the step
        for s, row, a in zip(seqs, emitted.tolist(), acc.tolist(), strict=True):
            s.extend(row[: a + 1])
        t2 = time.perf_counter()
        got = dev.propose(reqs)
        t3 = time.perf_counter()
        if step >= 3:
            host_ms.append((t1 - t0) * 1e3)
            propose_ms.append((t3 - t2) * 1e3)
            gpu_us.append(start.elapsed_time(end) * 1e3)
        want = host.propose(reqs)
        assert got.tokens.tolist() == want.tokens.tolist()
    assert dev.ready_hits >= 256 * 50
    print(
        f"\nn-gram verify follow-up, 256 sequences of 500-2048 tokens (median of 50): "
        f"staging + queueing {statistics.median(host_ms):.3f} ms, the next propose "
        f"{statistics.median(propose_ms):.3f} ms (drafts ready), the kernel on the GPU "
        f"{statistics.median(gpu_us):.1f} us; same drafts as the host proposer"
    )
