"""The engine thread behind the server: delivery, abort on close, failed steps, queue limit."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvscale.server.api.metrics import ServerMetrics
from kvscale.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    EngineStepError,
    QueueFullError,
)
from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.sampling_params import SamplingParams

PROMPT = [1, 415, 2936, 9060, 285]


@pytest.fixture(scope="module")
def engine(llama_ckpt: Path) -> Iterator[LLMEngine]:
    eng = LLMEngine(EngineConfig(model=str(llama_ckpt), device="cpu", num_kv_blocks=64))
    yield eng


def _clean(engine: LLMEngine) -> None:
    assert not engine.requests
    s = engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total and s.num_running == s.num_waiting == 0


def test_outputs_are_cumulative_and_match_the_offline_engine(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("ref", PROMPT, params)
    ref = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            ref = out

    async def run() -> list:
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            return [o async for o in aeng.generate("a", PROMPT, params)]
        finally:
            aeng.shutdown()

    outs = asyncio.run(run())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert outs[-1].outputs[0].text == ref.outputs[0].text
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens == sorted(lens) and lens[-1] == 12
    _clean(engine)


def test_closing_a_group_aborts_its_requests(engine: LLMEngine) -> None:
    metrics = ServerMetrics("m")

    async def run() -> None:
        aeng = AsyncEngine(engine, observer=metrics.timer)
        aeng.start()
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True, n=2)
            group = aeng.submit([EngineRequest("g", PROMPT, params)])
            await group.accepted()
            async with group:
                async for out in group:
                    if len(out.outputs[0].token_ids) >= 3:
                        break
            for _ in range(200):
                if aeng.stats().kv_blocks_free == aeng.stats().kv_blocks_total:
                    break
                await asyncio.sleep(0.01)
            s = aeng.stats()
            assert s.kv_blocks_free == s.kv_blocks_total and s.finished.get("abort") == 1
        finally:
            aeng.shutdown()

    asyncio.run(run())
    _clean(engine)
    assert metrics.timer.num_tracked == 0


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def run() -> None:
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            params = SamplingParams(max_tokens=50, ignore_eos=True)
            with pytest.raises(EngineStepError, match="boom"):
                async for _ in aeng.generate("doomed", PROMPT, params):
                    pass
            outs = [o async for o in aeng.generate("fine", PROMPT, SamplingParams(max_tokens=4))]
            assert outs[-1].finished
            assert aeng.is_alive() and aeng.num_step_errors == 1
        finally:
            aeng.shutdown()

    asyncio.run(run())
    _clean(engine)


def test_bad_input_is_refused_at_acceptance(engine: LLMEngine) -> None:
    async def run() -> None:
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            bad = SamplingParams(stop_token_ids=[10**9])
            group = aeng.submit([EngineRequest("ok", PROMPT, SamplingParams(max_tokens=2)),
                                 EngineRequest("bad", PROMPT, bad)])  # fmt: skip
            with pytest.raises(ValueError, match="stop_token_ids"):
                await group.accepted()
            group.close()  # aborts "ok" too
            for _ in range(200):
                if not aeng.stats().num_running and not aeng.stats().num_waiting:
                    break
                await asyncio.sleep(0.01)
        finally:
            aeng.shutdown()

    asyncio.run(run())
    _clean(engine)


def test_queue_limit_and_dead_engine(engine: LLMEngine) -> None:
    async def run() -> None:
        aeng = AsyncEngine(engine, max_queue_len=1)
        with pytest.raises(EngineDeadError):
            aeng.submit([EngineRequest("x", PROMPT, SamplingParams())])
        aeng.start()
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        first = aeng.submit([EngineRequest("q1", PROMPT, params)])
        with pytest.raises(QueueFullError) as e:  # q1 is still pending: 1 waiting
            aeng.submit([EngineRequest("q2", PROMPT, params)])
        assert e.value.limit == 1
        await first.accepted()
        aeng.shutdown()
        assert not aeng.is_alive()
        with pytest.raises(EngineDeadError):
            async for _ in first:
                pass
        first.close()

    asyncio.run(run())
    for rid in list(engine.requests):  # the loop stopped with q1 in the engine
        engine.abort_request(rid)
    _clean(engine)
