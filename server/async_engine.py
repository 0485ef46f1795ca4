"""Drives one LLMEngine from a background thread for an asyncio server.

The engine is not thread-safe, so exactly one thread (the engine loop) touches it: it
drains an inbox of add/abort commands, calls ``step()`` while there is work and sleeps
on a condition variable when idle. Outputs go back to the event loop in one
``loop.call_soon_threadsafe`` call per step and land in the asyncio queue of the
``RequestGroup`` that submitted the request. The event loop never waits on model
compute.

A step that raises fails the requests in flight (they get an ``EngineStepError``) and
the loop keeps serving. Closing a ``RequestGroup`` before its requests finish (a client
that disconnected) aborts them in the engine at once, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvscale.server.engine.llm_engine import EngineStats, LLMEngine
from kvscale.server.outputs import RequestOutput
from kvscale.server.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # the idle loop wakes this often to refresh its heartbeat (seconds)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (stopped, or it crashed)."""


class EngineStepError(RuntimeError):
    """A model step failed; every request that was in flight fails with this."""


class QueueFullError(RuntimeError):
    """Too many sequences are already waiting (``max_queue_len``)."""

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(
            f"the server is at capacity: {num_waiting} sequences are waiting "
            f"(max_queue_len={limit}); retry later"
        )
        self.num_waiting = num_waiting
        self.limit = limit


class EngineObserver(Protocol):
    """Called from the engine thread; used for the latency histograms."""

    def on_add(self, request_id: str, arrival_time: float) -> None: ...

    def on_step(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


@dataclass
class EngineRequest:
    """One engine request: a tokenized prompt and its sampling settings."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Add:
    request: EngineRequest
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


_ACCEPTED = object()  # payload sent back when an add succeeded


class RequestGroup:
    """The outputs of one or more engine requests submitted together (n prompts).

    ``await group.accepted()`` raises the ValueError of any request the engine refused.
    ``async for out in group`` yields RequestOutputs (cumulative, so outputs the consumer
    had no time to read are skipped: only the latest state of each request is kept)
    until every request finished. Always ``close()`` it (or use ``async with``): that
    aborts unfinished requests.
    """

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str]) -> None:
        self._engine = engine
        self.request_ids = list(request_ids)
        self._unfinished = set(self.request_ids)
        self._to_accept = set(self.request_ids)
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._latest: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self._closed = False

    # ---- called on the event loop by AsyncEngine._dispatch ------------------------------
    def _put(self, request_id: str, payload: object) -> None:
        refused = isinstance(payload, ValueError) and request_id in self._to_accept
        if payload is _ACCEPTED or refused:
            self._to_accept.discard(request_id)
            if isinstance(payload, ValueError):
                self._unfinished.discard(request_id)
                if not self._accepted.done():
                    self._accepted.set_exception(payload)
            elif not self._to_accept and not self._accepted.done():
                self._accepted.set_result(None)
            return
        if isinstance(payload, BaseException):
            self._error = payload
            self._unfinished.discard(request_id)
            if not self._accepted.done():
                self._accepted.set_exception(payload)
        elif isinstance(payload, RequestOutput):
            self._latest[request_id] = payload
        self._wakeup.set()

    # ---- consumer API --------------------------------------------------------------------
    async def accepted(self) -> None:
        """Returns once the engine queued every request; raises ValueError for bad input."""
        await self._accepted

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest:
                rid = next(iter(self._latest))
                out = self._latest.pop(rid)
                if out.finished:
                    self._unfinished.discard(rid)
                return out
            if self._error is not None:
                raise self._error
            if not self._unfinished or self._closed:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()

    def close(self) -> None:
        """Aborts every request of the group that has not finished; idempotent."""
        if self._closed:
            return
        self._closed = True
        for rid in self._unfinished:
            self._engine.abort(rid)
        self._engine._groups_remove(self.request_ids)
        if not self._accepted.done():
            self._accepted.cancel()
        elif not self._accepted.cancelled():
            self._accepted.exception()  # retrieved: no "never retrieved" warning
        self._wakeup.set()

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncEngine:
    """Owns the engine thread. Create and use it from one event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queue_len: int | None = None,
        observer: EngineObserver | None = None,
    ) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.observer = observer
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._cond = threading.Condition()
        self._inbox: deque[_Add | _Abort] = deque()
        self._pending_seqs = 0  # sequences submitted but not yet added to the engine
        self._stopping = False
        self._stats: EngineStats = engine.stats()
        self._groups: dict[str, RequestGroup] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.heartbeat = time.monotonic()
        self.num_step_errors = 0

    # ---- read-only helpers (safe on the event loop: they do not touch engine state) ------
    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    def tokenize(self, text: str) -> list[int]:
        """A prompt's token ids, as the engine would tokenize it (BOS included)."""
        return self.engine.tokenize(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvscale-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread (in-flight requests fail with EngineDeadError)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def seconds_since_heartbeat(self) -> float:
        """Seconds since the engine loop last finished an iteration (or idled)."""
        return time.monotonic() - self.heartbeat

    def stats(self) -> EngineStats:
        """The latest snapshot (taken by the engine thread after each iteration)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Sequences waiting in the engine plus those submitted but not yet added."""
        with self._cond:
            return self._stats.num_waiting + self._pending_seqs

    # ---- requests ---------------------------------------------------------------------
    def submit(
        self, requests: Sequence[EngineRequest], arrival_time: float | None = None
    ) -> RequestGroup:
        """Queues requests for the engine thread and returns their group at once.

        Raises EngineDeadError if the loop is not running and QueueFullError if
        ``max_queue_len`` sequences are already waiting; nothing is queued then.
        """
        if not self.is_alive():
            raise EngineDeadError("the engine loop is not running")
        rids = [r.request_id for r in requests]
        if len(set(rids)) != len(rids) or any(r in self._groups for r in rids):
            raise ValueError("request ids must be unique")
        group = RequestGroup(self, rids)
        now = time.monotonic() if arrival_time is None else arrival_time
        n = sum(r.params.n for r in requests)
        with self._cond:
            waiting = self._stats.num_waiting + self._pending_seqs
            if self.max_queue_len is not None and waiting >= self.max_queue_len:
                raise QueueFullError(waiting, self.max_queue_len)
            for r in requests:
                self._groups[r.request_id] = group
                self._inbox.append(_Add(r, now))
            self._pending_seqs += n
            self._cond.notify()
        return group

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> _Generate:
        """``async for out in engine.generate(...)``: one request; aborts when closed early."""
        return _Generate(self, EngineRequest(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        """Asks the engine thread to drop a request (no-op if it already finished)."""
        with self._cond:
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    def _groups_remove(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._groups.pop(rid, None)

    def _dispatch(self, events: list[tuple[str, object]]) -> None:
        """On the event loop: hands each (request id, payload) to its group."""
        for rid, payload in events:
            group = self._groups.get(rid)
            if group is not None:
                group._put(rid, payload)

    def _send(self, events: list[tuple[str, object]]) -> None:
        if not events or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cond:
                    while not self._inbox and not eng.has_unfinished_requests():
                        if self._stopping:
                            break
                        self.heartbeat = time.monotonic()
                        self._cond.wait(IDLE_WAIT_S)
                    if self._stopping:
                        break
                    cmds = list(self._inbox)
                    self._inbox.clear()
                events = self._apply(cmds)
                if eng.has_unfinished_requests():
                    events.extend(self._step())
                with self._cond:
                    self._pending_seqs -= sum(
                        c.request.params.n for c in cmds if isinstance(c, _Add)
                    )
                    self._stats = eng.stats()
                self.heartbeat = time.monotonic()
                self._send(events)
        except BaseException:
            log.exception("the engine loop crashed")
            raise
        finally:
            self._stopping = True
            self._fail_all(EngineDeadError("the engine loop stopped"))

    def _apply(self, cmds: list[_Add | _Abort]) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        for cmd in cmds:
            if isinstance(cmd, _Add):
                r = cmd.request
                try:
                    self.engine.add_request(
                        r.request_id, r.prompt_token_ids, r.params, cmd.arrival_time
                    )
                except ValueError as e:
                    events.append((r.request_id, e))
                    continue
                except Exception as e:
                    log.exception("add_request failed for %s", r.request_id)
                    events.append((r.request_id, EngineStepError(f"cannot queue request: {e}")))
                    continue
                if self.observer is not None:
                    self.observer.on_add(r.request_id, cmd.arrival_time)
                events.append((r.request_id, _ACCEPTED))
            elif self.engine.abort_request(cmd.request_id) and self.observer is not None:
                self.observer.on_abort(cmd.request_id)
        return events

    def _step(self) -> list[tuple[str, object]]:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.num_step_errors += 1
            log.exception("engine step failed; failing the requests in flight")
            return self._fail_in_flight(EngineStepError(f"engine step failed: {e}"))
        now = time.monotonic()
        for out in outputs:
            for c in out.outputs:
                if c.logprobs is not None:  # the engine keeps appending to its own list
                    c.logprobs = list(c.logprobs)
        if self.observer is not None:
            try:
                self.observer.on_step(outputs, now)
            except Exception:
                log.exception("metrics observer failed")
        return [(out.request_id, out) for out in outputs]

    def _fail_in_flight(self, error: BaseException) -> list[tuple[str, object]]:
        events: list[tuple[str, object]] = []
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort after a failed step failed for %s", rid)
                self.engine.requests.pop(rid, None)
            if self.observer is not None:
                self.observer.on_abort(rid)
            events.append((rid, error))
        return events

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            cmds = list(self._inbox)
            self._inbox.clear()
        events = [(c.request.request_id, error) for c in cmds if isinstance(c, _Add)]
        events += [(rid, error) for rid in list(self.engine.requests)]
        self._send(events)


class _Generate:
    """Async iterator over one request's outputs; aborts it if closed before it finishes."""

    def __init__(self, engine: AsyncEngine, request: EngineRequest) -> None:
        self._engine = engine
        self._request = request
        self._group: RequestGroup | None = None

    def __aiter__(self) -> _Generate:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._group is None:
            self._group = self._engine.submit([self._request])
            try:
                await self._group.accepted()
            except BaseException:
                self._group.close()
                raise
        try:
            return await self._group.__anext__()
        except BaseException:  # StopAsyncIteration, errors, cancellation
            self._group.close()
            raise

    async def aclose(self) -> None:
        if self._group is not None:
            self._group.close()
