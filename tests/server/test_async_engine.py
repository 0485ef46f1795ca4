"""The API side of the engine and the engine process: delivery, abort on close, failed
steps, a dead engine, bad input and the queue limit (real processes on CPU)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvscale.server import LLM
from kvscale.server.api.metrics import ServerMetrics
from kvscale.server.config import EngineConfig
from kvscale.server.errors import InvalidRequestError
from kvscale.server.process.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    EngineStepError,
    QueueFullError,
)
from kvscale.server.sampling_params import SamplingParams

from .engine_faults import run_failing_to_load, run_instant_engine, run_with_failing_third_step

PROMPT = [1, 415, 2936, 9060, 285]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned engine processes copy sys.path: let them import tests.server.engine_faults."""
    monkeypatch.syspath_prepend(str(ROOT))


def _config(ckpt: Path) -> EngineConfig:
    return EngineConfig(model=str(ckpt), device="cpu", num_kv_blocks=64)


def _run(
    ckpt: Path,
    body: Callable[[AsyncEngine], Any],
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    **kw: Any,
) -> Any:
    """Starts an AsyncEngine on a fresh event loop, runs ``body``, always shuts down."""

    async def main() -> Any:
        aeng = AsyncEngine(_config(ckpt), **kw)
        await aeng.start()
        try:
            return await body(aeng)
        finally:
            aeng.shutdown()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


async def _wait_idle(aeng: AsyncEngine) -> None:
    for _ in range(300):
        s = aeng.stats()
        if s.kv_blocks_free == s.kv_blocks_total and not s.num_running and not s.num_waiting:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {aeng.stats()}")


def test_outputs_are_cumulative_and_match_the_offline_engine(llama_ckpt: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=["\n\n\n"])
    ref = LLM(str(llama_ckpt), device="cpu", num_kv_blocks=64).generate([PROMPT], params)[0]

    async def body(aeng: AsyncEngine) -> list:
        outs = [o async for o in aeng.generate("a", PROMPT, params)]
        await _wait_idle(aeng)
        return outs

    outs = _run(llama_ckpt, body)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert outs[-1].outputs[0].text == ref.outputs[0].text
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens == sorted(lens) and lens[-1] == 12


def test_closing_a_group_aborts_its_requests(llama_ckpt: Path) -> None:
    metrics = ServerMetrics("m")

    async def body(aeng: AsyncEngine) -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True, n=2)
        group = aeng.submit([EngineRequest("g", PROMPT, params)])
        async with group:
            async for out in group:
                if len(out.outputs[0].token_ids) >= 3:
                    break
        await _wait_idle(aeng)
        assert aeng.stats().finished == {"abort": 1}
        assert not aeng.processor.requests

    _run(llama_ckpt, body, observer=metrics.timer)
    assert metrics.timer.num_tracked == 0


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(
    llama_ckpt: Path, importable_tests: None
) -> None:
    async def body(aeng: AsyncEngine) -> None:
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in aeng.generate("doomed", PROMPT, params):
                pass
        outs = [o async for o in aeng.generate("fine", PROMPT, SamplingParams(max_tokens=4))]
        assert outs[-1].finished
        assert aeng.is_alive() and aeng.num_step_errors == 1
        await _wait_idle(aeng)

    _run(llama_ckpt, body, process_target=run_with_failing_third_step)


def test_a_killed_engine_process_fails_requests_in_flight(llama_ckpt: Path) -> None:
    async def body(aeng: AsyncEngine) -> None:
        reasons: list[str] = []
        aeng.on_dead = reasons.append  # the server exits non-zero with it
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        killed = False
        with pytest.raises(EngineDeadError, match="exit code -9"):
            async for out in aeng.generate("victim", PROMPT, params):
                # >=, not ==: on a busy machine one output can carry several new tokens.
                if len(out.outputs[0].token_ids) >= 2 and not killed:
                    os.kill(aeng._proc.pid, signal.SIGKILL)
                    killed = True
        assert not aeng.is_alive()
        assert reasons == ["the engine process exited unexpectedly (exit code -9)"]
        with pytest.raises(EngineDeadError):
            aeng.submit([EngineRequest("late", PROMPT, params)])

    _run(llama_ckpt, body)


def test_a_model_that_cannot_load_is_reported(llama_ckpt: Path, importable_tests: None) -> None:
    async def main() -> None:
        aeng = AsyncEngine(_config(llama_ckpt), process_target=run_failing_to_load)
        with pytest.raises(RuntimeError, match="out of memory"):
            await aeng.start()
        assert not aeng.is_alive() and aeng._proc.exitcode is not None

    asyncio.run(main())


def test_bad_input_is_refused_at_submission(llama_ckpt: Path) -> None:
    async def body(aeng: AsyncEngine) -> None:
        ok = EngineRequest("ok", PROMPT, SamplingParams(max_tokens=2))
        bad = EngineRequest("bad", PROMPT, SamplingParams(stop_token_ids=[10**9]))
        with pytest.raises(ValueError, match="stop_token_ids"):
            aeng.submit([ok, bad])
        with pytest.raises(ValueError, match="prompt token ids"):
            aeng.submit([EngineRequest("oov", [1, 10**9], SamplingParams())])
        assert not aeng.processor.requests  # nothing was queued, "ok" included
        await asyncio.sleep(0.2)
        assert aeng.stats().num_waiting == aeng.stats().num_running == 0

    _run(llama_ckpt, body)


def test_queue_limit_and_dead_engine(llama_ckpt: Path) -> None:
    async def main() -> None:
        cfg = EngineConfig(model=str(llama_ckpt), device="cpu", num_kv_blocks=64, max_num_seqs=1)
        aeng = AsyncEngine(cfg, max_queue_len=1)
        with pytest.raises(EngineDeadError):
            aeng.submit([EngineRequest("x", PROMPT, SamplingParams())])
        await aeng.start()
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        first = aeng.submit([EngineRequest("q1", PROMPT, params)])  # takes the one slot
        second = aeng.submit([EngineRequest("q2", PROMPT, params)])  # waits: 1 queued
        with pytest.raises(QueueFullError) as e:  # would make 2 wait
            aeng.submit([EngineRequest("q3", PROMPT, params)])
        assert e.value.limit == 1 and e.value.num_waiting == 2
        aeng.shutdown()
        assert not aeng.is_alive()
        for group in (first, second):
            with pytest.raises(EngineDeadError):
                async for _ in group:
                    pass
            group.close()

    asyncio.run(main())


def test_admission_counts_sequences_that_cannot_start(llama_ckpt: Path) -> None:
    """``max_queue_len`` counts sequences (n each) that would wait for a batch slot: a
    burst that fits the free slots is admitted whole; an n that overflows is refused."""

    async def main() -> None:
        cfg = EngineConfig(model=str(llama_ckpt), device="cpu", num_kv_blocks=64, max_num_seqs=4)
        aeng = AsyncEngine(cfg, max_queue_len=1)
        await aeng.start()
        try:
            params = SamplingParams(max_tokens=300, ignore_eos=True)
            groups = [aeng.submit([EngineRequest(f"r{i}", PROMPT, params)]) for i in range(5)]
            with pytest.raises(QueueFullError):  # 4 running, 1 queued: the limit
                aeng.submit([EngineRequest("r5", PROMPT, params)])
            big = SamplingParams(n=6, max_tokens=8, ignore_eos=True)
            with pytest.raises(InvalidRequestError) as e:  # 6 > 4 slots + 1 queued, ever
                aeng.submit([EngineRequest("n6", PROMPT, big)])
            assert e.value.param == "n"
            for g in groups:
                g.close()
            await _wait_until(lambda: aeng.queued_after(0) == 0 and not aeng.stats().num_running)
            five = SamplingParams(n=5, max_tokens=300, ignore_eos=True)
            group = aeng.submit([EngineRequest("n5", PROMPT, five)])  # 4 start, 1 waits
            with pytest.raises(QueueFullError):  # one more would make 2 wait
                aeng.submit([EngineRequest("one", PROMPT, SamplingParams(max_tokens=2))])
            group.close()
        finally:
            aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 120))


async def _wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


def test_a_flood_of_steps_under_uvloop_reaches_every_stream(
    llama_ckpt: Path, importable_tests: None
) -> None:
    """256 streams fed by an engine that steps every 2 ms (as a GPU does), on uvloop as
    under uvicorn: uvloop makes the pipe it polls non-blocking, so the API process must
    read partial messages and the commands must not share that pipe (they once did: a
    full socket buffer killed the sender and the server hung)."""
    uvloop = pytest.importorskip("uvloop")
    num, tokens = 256, 300

    async def consume(aeng: AsyncEngine, i: int) -> int:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        last = None
        prompt = [(i * 7 + j) % 30000 + 3 for j in range(600)]  # adds outgrow the pipe
        async for out in aeng.generate(f"r{i}", prompt, params):
            last = out
        assert last is not None and last.finished
        return len(last.outputs[0].token_ids)

    async def body(aeng: AsyncEngine) -> list[int]:
        jobs = asyncio.gather(*(consume(aeng, i) for i in range(num)))
        return await asyncio.wait_for(jobs, timeout=120)

    lens = _run(
        llama_ckpt, body, loop_factory=uvloop.new_event_loop, process_target=run_instant_engine
    )
    assert lens == [tokens] * num


@pytest.mark.parametrize(
    "max_num_seqs,max_queue_len,max_model_len", [(8, None, None), (1, 0, None), (8, None, 12)]
)
def test_the_warm_up_shares_a_prefix_and_admits_its_requests_whatever_the_limits(
    llama_ckpt: Path, max_num_seqs: int, max_queue_len: int | None, max_model_len: int | None
) -> None:
    """The server's warm-up (three requests, one sharing the first's whole blocks) runs
    even where one sequence runs at a time and none may wait, or a context holds only a
    few tokens, and leaves the queue limit as it was."""
    from kvscale.server.api.app import WARMUP_TOKENS, _warm_up

    async def main() -> None:
        cfg = EngineConfig(
            model=str(llama_ckpt),
            device="cpu",
            num_kv_blocks=64,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        aeng = AsyncEngine(cfg, max_queue_len=max_queue_len)
        await aeng.start()
        try:
            await _warm_up(aeng)
            await _wait_idle(aeng)
            s = aeng.stats()
            assert aeng.max_queue_len == max_queue_len
            assert s.generation_tokens == 3 * WARMUP_TOKENS
            if max_model_len is None:  # the second prompt found the first's 48 tokens' blocks
                assert s.prefix_cache_hits >= 32
        finally:
            aeng.shutdown()

    asyncio.run(main())
