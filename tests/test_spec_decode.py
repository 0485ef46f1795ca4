"""Speculative decoding in the engine (n-gram proposer): greedy outputs token-identical to
greedy without speculation on mixed batches (chunked prefill, forced preemption, rows
that cannot speculate, penalties), block-pool invariants after every step, acceptance on
a model that repeats itself, seeded sampling reproducible, the batch-size switch back to
pipelined steps, and the metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscale.server import LLM, SamplingParams
from kvscale.server.engine.core_outputs import EngineStats
from kvscale.server.engine.sequence import Sequence, SequenceStatus
from kvscale.server.engine.speculation import (
    MISS_PAUSE_MAX,
    SpecStats,
    Speculator,
    adapt,
    may_draft,
)
from kvscale.server.spec_decode.ngram_proposer import NgramProposer
from tests.draft_helpers import perturbed_copy
from tests.hf_reference import random_prompts

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)
# a small pool and token budget: chunked prefill and preemption in every run
TIGHT = dict(
    device="cpu", num_kv_blocks=40, max_model_len=192, block_size=8,
    max_num_batched_tokens=32, max_num_seqs=8,
)  # fmt: skip


def _prompts() -> list[list[int]]:
    prompts = random_prompts(10, (2, 60), seed=4)
    return [p + p[: len(p) // 2] for p in prompts]  # each repeats part of itself


def _run_checked(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Generates step by step, checking the block pool against the live tables after
    every step; returns the outputs in prompt order."""
    eng = llm.engine
    core = eng.core
    ids = []
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.queue(f"r{i}", p, eng.prepare(p, sp), sp)
        ids.append(f"r{i}")
    done = {}
    for _ in range(10_000):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        live = [s.block_table for r in core.requests.values() for s in r.seqs]
        core.block_manager.check(live)
        if len(done) == len(ids):
            break
    assert len(done) == len(ids)
    core.block_manager.check([])
    return [done[r] for r in ids]


@pytest.mark.parametrize("model", ["random", "echo"])
def test_greedy_is_identical_with_ngram_speculation(
    model: str, llama_ckpt: Path, echo_ckpt: Path
) -> None:
    path = str(llama_ckpt if model == "random" else echo_ckpt)
    prompts = _prompts()
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # rows that never speculate, in the same batches: logprobs, and a repetition penalty
    # (which does speculate: penalties are applied per verified position)
    params = [greedy] * len(prompts)
    params[1] = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    params[2] = SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=1.3
    )
    params[3] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=20)
    base = _run_checked(LLM(path, **TIGHT), prompts, params)
    llm = LLM(path, **TIGHT, **NGRAM)
    spec = _run_checked(llm, prompts, params)
    for i, (b, s) in enumerate(zip(base, spec, strict=True)):
        assert s.outputs[0].token_ids == b.outputs[0].token_ids, i
    # other batch shapes change fp32 rounding, nothing else
    for got, want in zip(spec[1].outputs[0].logprobs, base[1].outputs[0].logprobs, strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    if model == "echo":
        assert stats.spec_num_drafts > 10
        # the model repeats its last token: n-gram lookup drafts it and it is accepted
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        assert stats.spec_accepted_per_pos[0] == stats.spec_num_drafts
        assert stats.spec_accepted_per_pos[3] > 0


def test_echo_model_accepts_k_plus_one_tokens_per_step(echo_ckpt: Path) -> None:
    llm = LLM(str(echo_ckpt), device="cpu", **NGRAM)
    prompt = [5, 9, 9, 9]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=41, ignore_eos=True))
    assert out[0].outputs[0].token_ids == [9] * 41
    s = llm.engine.stats()
    # the prefill emits 1 token, then every step drafts 4 and emits 5: 1 + 8 * 5
    assert s.spec_num_drafts == 41 // 5 and s.spec_num_accepted_tokens == 4 * s.spec_num_drafts
    assert s.spec_accepted_per_pos == [s.spec_num_drafts] * 4


def test_seeded_sampling_with_speculation_is_reproducible(echo_ckpt: Path) -> None:
    llm = LLM(str(echo_ckpt), device="cpu", **NGRAM)
    prompts = _prompts()[:4]
    sp = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=7)
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], sp)][::-1]
    assert a == b  # the same seeds give the same tokens, whatever else is in the batch
    assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_large_batches_run_pipelined_steps_without_drafts(echo_ckpt: Path) -> None:
    prompts = _prompts()
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    base = LLM(str(echo_ckpt), device="cpu").generate(prompts, sp)
    llm = LLM(str(echo_ckpt), device="cpu", speculative_disable_by_batch_size=3, **NGRAM)
    core = llm.engine.core
    seen_inflight_with_many = False
    real_step = core.step

    def step():  # records whether a step with > 3 running sequences was pipelined
        nonlocal seen_inflight_with_many
        out = real_step()
        if core.scheduler.num_running > 3 and core._inflight is not None:
            seen_inflight_with_many = True
        return out

    core.step = step  # type: ignore[method-assign]
    got = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in base]
    assert seen_inflight_with_many
    assert llm.engine.stats().spec_num_drafts == 0  # all 10 ran at once, each 16 steps


def _seq(**kw) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 10))
    s = Sequence(0, "r", 0, [1, 2, 3], params)
    s.status = SequenceStatus.RUNNING
    s.num_computed_tokens = s.num_tokens - 1
    s.spec_k = 4
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_may_draft_and_adapt() -> None:
    assert may_draft(_seq(), 100) == 4
    assert may_draft(_seq(max_tokens=3), 100) == 2  # 3 tokens left: 2 drafts + 1
    assert may_draft(_seq(), 6) == 2  # the context: 3 tokens + 2 drafts + 1 <= 6
    assert may_draft(_seq(num_computed_tokens=1), 100) == 0  # still prefilling
    assert may_draft(_seq(stopping=True), 100) == 0
    assert may_draft(_seq(spec_pause=2), 100) == 0
    s = _seq()
    adapt(s, 4, 4, 4)
    assert s.spec_k == 4
    adapt(s, 4, 1, 4)
    assert s.spec_k == 2
    for _ in range(10):
        adapt(s, s.spec_k, 0, 4)
    assert s.spec_pause > 0 and s.spec_k == 1
    st = SpecStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6)
    assert st.acceptance_rate == 0.5 and st.mean_accepted_length == 2.5


def test_drafts_stay_on_the_device_for_an_in_process_draft_on_one_rank(
    llama_ckpt: Path,
) -> None:
    """Only a proposer that can leave its drafts on the device does, and only for a
    single-rank target (other tensor-parallel ranks receive host arrays only)."""
    from kvscale.server.spec_decode.draft_runner import DraftRunner, draft_engine_config

    runner = DraftRunner.from_engine_config(
        draft_engine_config(str(llama_ckpt), device="cpu", num_kv_blocks=16), 3
    )
    assert Speculator(runner, 3, 8).on_device
    assert not Speculator(runner, 3, 8, single_rank=False).on_device
    assert not Speculator(NgramProposer(k=3, min_n=1, max_n=2), 3, 8).on_device


def test_empty_proposals_back_off_and_a_match_resumes() -> None:
    """n-gram on tokens that never repeat: proposals at steps 0, 2, 5, 10, 19, 36, 69, 134,
    199 (pauses 1, 2, 4, ..., then MISS_PAUSE_MAX); once the tokens repeat, drafting
    resumes."""
    spec = Speculator(NgramProposer(k=3, min_n=1, max_n=2), 3, disable_by_batch_size=8)
    seq = _seq(max_tokens=1000)
    seq.token_ids = list(range(100, 103))
    seq.num_computed_tokens = seq.num_tokens - 1
    proposed = []
    for step in range(200):
        if spec.ready([seq], 1000):
            spec.draft([seq], 1000)
            proposed.append(step)
            assert seq.draft_tokens == []
        seq.token_ids.append(200 + step)  # the step's token: never seen before
        seq.num_computed_tokens += 1
    assert MISS_PAUSE_MAX == 64 and proposed == [0, 2, 5, 10, 19, 36, 69, 134, 199]
    seq.token_ids += [7, 8, 9, 7, 8]  # repeats: "7 8" -> 9
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.spec_pause = 0
    assert spec.ready([seq], 1000)
    spec.draft([seq], 1000)
    assert seq.draft_tokens[:1] == [9] and seq.spec_misses == 0
    # a batch too large to speculate ticks no pauses and proposes nothing
    seq.spec_pause = 3
    assert not spec.ready([seq] * 9, 1000) and seq.spec_pause == 3


def test_requests_that_cannot_draft_run_pipelined_steps(echo_ckpt: Path) -> None:
    """With n-gram configured, a batch whose only request asks for logprobs (it cannot
    speculate) takes the normal pipelined steps, with the same tokens."""
    prompts = _prompts()[:1]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    base = LLM(str(echo_ckpt), device="cpu").generate(prompts, sp)
    llm = LLM(str(echo_ckpt), device="cpu", **NGRAM)
    core = llm.engine.core
    pipelined = 0
    real_step = core.step

    def step():  # counts the steps that left one in flight
        nonlocal pipelined
        out = real_step()
        pipelined += core._inflight is not None
        return out

    core.step = step  # type: ignore[method-assign]
    got = llm.generate(prompts, sp)
    assert got[0].outputs[0].token_ids == base[0].outputs[0].token_ids
    assert pipelined >= 15 and llm.engine.stats().spec_num_drafts == 0


def test_proposals_without_drafts_leave_the_step_in_flight(llama_ckpt: Path) -> None:
    """n-gram probes that find nothing (trigrams over tokens that do not repeat) do not
    cost the pipeline: the step they launch stays in flight behind the next one, as in a
    run without speculation; same tokens."""
    prompts = [list(range(5, 45))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(str(llama_ckpt), device="cpu").generate(prompts, sp)
    llm = LLM(
        str(llama_ckpt), device="cpu", speculative_method="ngram", num_speculative_tokens=3,
        ngram_min=3, ngram_max=3,
    )  # fmt: skip
    core = llm.engine.core
    drained, probes = 0, 0
    real_step, real_draft = core.step, core.speculator.draft

    def step():  # counts the steps that returned with nothing in flight
        nonlocal drained
        out = real_step()
        drained += core._inflight is None
        return out

    def draft(*a):
        nonlocal probes
        probes += 1
        return real_draft(*a)

    core.step = step  # type: ignore[method-assign]
    core.speculator.draft = draft  # type: ignore[method-assign]
    got = llm.generate(prompts, sp)
    assert got[0].outputs[0].token_ids == base[0].outputs[0].token_ids
    assert llm.engine.stats().spec_num_drafts == 0 and probes >= 4
    assert drained == 1  # the last step only: it reads the final token


def test_speculative_config_takes_vllm_keys(echo_ckpt: Path) -> None:
    llm = LLM(
        str(echo_ckpt),
        device="cpu",
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        },
    )
    eng = llm.engine.config.engine
    assert (eng.speculative_method, eng.num_speculative_tokens) == ("ngram", 3)
    assert (eng.ngram_min, eng.ngram_max) == (1, 2)
    with pytest.raises(ValueError, match="speculative_config: unknown key 'eagle_dir'"):
        LLM(str(echo_ckpt), device="cpu", speculative_config={"method": "ngram", "eagle_dir": 1})


def _draft_keeps_greedy_tokens(
    target: Path, draft: Path, params: list[SamplingParams], on_device: bool = True
) -> EngineStats:
    """``_prompts()`` on TIGHT settings without speculation and with ``draft`` in process
    (k = 3, its drafts left on the device or read on the host): the same tokens. Returns
    the speculative engine's stats."""
    prompts = _prompts()
    base = _run_checked(LLM(str(target), **TIGHT), prompts, params)
    llm = LLM(
        str(target), **TIGHT, speculative_method="draft",
        speculative_model=str(draft), num_speculative_tokens=3,
    )  # fmt: skip
    assert llm.engine.core.speculator.on_device  # the default for a draft in process
    llm.engine.core.speculator.on_device = on_device
    spec = _run_checked(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    return llm.engine.stats()


def test_inprocess_draft_equal_to_the_target_accepts_everything(llama_ckpt: Path) -> None:
    """Draft = target: greedy output unchanged on a mixed batch (chunked prefill,
    preemption, rows that do not draft), every draft accepted, k + 1 tokens per verify."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [greedy] * len(_prompts())
    params[1] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    s = _draft_keeps_greedy_tokens(llama_ckpt, llama_ckpt, params)
    assert s.num_preemptions > 0 and s.spec_num_drafts > 20
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    assert s.spec_accepted_per_pos[0] == s.spec_num_drafts


@pytest.fixture(scope="module")
def noisy_draft(llama_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(llama_ckpt, tmp_path_factory.mktemp("noisy") / "draft", 0.2)


@pytest.mark.parametrize("on_device", [True, False])
def test_inprocess_draft_of_another_model_keeps_greedy_tokens(
    llama_ckpt: Path, noisy_draft: Path, on_device: bool
) -> None:
    """A draft that agrees only sometimes (the target with noise, same tokenizer): the
    target's greedy tokens are unchanged on a mixed batch (penalties included), with the
    drafts left on the device (the worker places them into the verify step) and read on
    the host alike."""
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(_prompts())
    params[2] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.5)
    s = _draft_keeps_greedy_tokens(llama_ckpt, noisy_draft, params, on_device)
    assert s.spec_num_drafts > 20 and 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens


def test_inprocess_draft_sampling_is_reproducible(llama_ckpt: Path) -> None:
    llm = LLM(
        str(llama_ckpt), device="cpu", speculative_method="draft",
        speculative_model=str(llama_ckpt), num_speculative_tokens=3,
    )  # fmt: skip
    prompts = _prompts()[:4]
    # top_k=8: the target's distribution is the draft's top-8 q (the same model)
    sp = SamplingParams(temperature=1.0, top_k=8, max_tokens=20, ignore_eos=True, seed=11)
    assert llm.engine.core.speculator.on_device  # q, too, placed on the device
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], sp)][::-1]
    assert a == b
    s = llm.engine.stats()
    # p == q up to rounding: accept with probability min(1, p/q) = 1
    assert s.spec_num_accepted_tokens >= 0.95 * s.spec_num_draft_tokens


def test_switching_between_speculative_and_pipelined_steps(echo_ckpt: Path) -> None:
    """Sequences come and go around the batch-size switch, with a token budget that leaves
    some drafted sequences unscheduled: greedy tokens stay those of no speculation."""
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(10)
    ]
    base = _run_checked(LLM(str(echo_ckpt), **TIGHT), prompts, params)
    llm = LLM(str(echo_ckpt), **TIGHT, **{**NGRAM, "speculative_disable_by_batch_size": 4})
    spec = _run_checked(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
    assert llm.engine.stats().spec_num_drafts > 0
