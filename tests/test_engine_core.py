"""The pipelined engine core: launch order, no wasted rows, stops and aborts mid-flight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.worker import PendingStep

PROMPTS = [[1, 415, 2936, 9060, 285], [1, 22, 333, 4444], [1, 7, 8]]


@pytest.fixture
def engine(llama_ckpt: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(llama_ckpt), device="cpu", num_kv_blocks=64))


def _trace(eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Records ("launch", rows) and ("result", rows) in the order they happen."""
    events: list[tuple[str, int]] = []
    launch, result = eng.worker.launch, PendingStep.result

    def traced_launch(step: Any) -> PendingStep:
        pending = launch(step)
        events.append(("launch", pending.num_rows))
        return pending

    def traced_result(self: PendingStep) -> Any:
        events.append(("result", self.num_rows))
        return result(self)

    monkeypatch.setattr(eng.worker, "launch", traced_launch)
    monkeypatch.setattr(PendingStep, "result", traced_result)
    return events


def _run(eng: LLMEngine) -> dict[str, Any]:
    final = {}
    for _ in range(1000):
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        if not eng.has_unfinished_requests():
            return final
    raise AssertionError("the engine did not finish")


def _clean(eng: LLMEngine) -> None:
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not eng.core.requests


def test_the_next_step_is_launched_before_the_last_one_is_read(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = _trace(engine, monkeypatch)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    final = _run(engine)
    assert all(len(o.outputs[0].token_ids) == 6 for o in final.values())
    kinds = [k for k, _ in events]
    # launch 1, then (launch N+1, result N) ..., then the last result alone
    assert kinds[:3] == ["launch", "launch", "result"]
    assert kinds.count("launch") == kinds.count("result")
    for i, k in enumerate(kinds):
        if k == "result":
            assert kinds[:i].count("launch") > kinds[:i].count("result")
    # max_tokens is known ahead: no row computes a token past it
    assert sum(n for k, n in events if k == "launch") == 3 * 6
    assert engine.stats().generation_tokens == 3 * 6
    _clean(engine)


def test_a_stop_token_costs_at_most_one_extra_row(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("ref", PROMPTS[0], greedy)
    ref = _run(engine)["ref"].outputs[0].token_ids
    stop_at = ref[2]
    events = _trace(engine, monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop_at])
    engine.add_request("s", PROMPTS[0], params)
    out = _run(engine)["s"].outputs[0]
    assert out.token_ids == ref[: ref.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    rows = sum(n for k, n in events if k == "launch")
    assert len(out.token_ids) <= rows <= len(out.token_ids) + 1
    _clean(engine)


def test_a_stop_string_ends_one_sample_in_the_core(engine: LLMEngine) -> None:
    probe = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True)
    engine.add_request("probe", PROMPTS[1], probe)
    texts = [c.text for c in _run(engine)["probe"].outputs]
    assert texts[0] != texts[1]
    stop = texts[0][len(texts[0]) // 2 :][:3]  # text inside sample 0, not in sample 1
    assert stop and stop not in texts[1]
    params = SamplingParams(
        max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True, stop=[stop]
    )
    engine.add_request("s", PROMPTS[1], params)
    seen_running_after_stop = False
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].finished and not out.outputs[1].finished:
                seqs = engine.core.requests["s"].seqs
                seen_running_after_stop = seqs[0].is_finished and not seqs[1].is_finished
            if out.finished:
                final = out
    assert final is not None and seen_running_after_stop
    a, b = final.outputs
    assert a.finish_reason == "stop" and a.stop_reason == stop
    assert a.text == texts[0][: texts[0].index(stop)]
    assert b.finish_reason == "length" and b.text == texts[1]
    _clean(engine)


def test_abort_with_a_step_in_flight(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("keep", PROMPTS[0], params)
    engine.add_request("drop", PROMPTS[1], params)
    for _ in range(4):
        engine.step()
    assert engine.core._inflight is not None
    assert engine.abort_request("drop")
    final = _run(engine)
    assert list(final) == ["keep"] and len(final["keep"].outputs[0].token_ids) == 30
    assert engine.stats().finished == {"abort": 1, "length": 1}
    _clean(engine)
