"""The API server's side of the engine: the engine process, and outputs as asyncio streams.

``AsyncEngine`` loads the tokenizer, resolves the configuration once (``ResolvedConfig``,
handed whole to the engine process), validates requests (the engine's one validation
point), starts the engine process (``engine_process``) and talks to it over two one-way
pipes with the typed ``messages``: a sender thread writes commands (blocking writes);
the event loop itself reads each step's token updates as they arrive (``frames``: no
thread to hand over to, so no lock ping-pong, and a partly written message never
blocks the loop), the ``OutputProcessor``
detokenizes them and each ``RequestGroup`` gets its requests' latest outputs. Neither
the HTTP layer nor detokenization runs in the engine's interpreter, so they never
stall the engine loop, and the event loop never waits on model compute.

A step that raises in the engine fails the requests in flight (they get an
``EngineStepError``) and the engine keeps serving. An engine that dies (its process
exits, or it reports ``Fatal``: a tensor-parallel rank died or hangs) fails every
request with an ``EngineDeadError`` carrying the reason and calls ``on_dead(reason)``
(the server then exits non-zero). Closing a ``RequestGroup`` before its
requests finish (a client that disconnected) aborts them in the engine, which frees
their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Protocol

from kvscale.server.config import EngineConfig
from kvscale.server.engine.core_outputs import EngineStats, SeqUpdate
from kvscale.server.engine.output_processor import OutputProcessor
from kvscale.server.engine.request import validate_request
from kvscale.server.errors import InvalidRequestError
from kvscale.server.outputs import RequestOutput
from kvscale.server.process.engine_process import run_engine_process
from kvscale.server.process.frames import MessageProtocol
from kvscale.server.process.messages import (
    AbortRequest,
    AddRequest,
    Command,
    Fatal,
    FinishSequence,
    Idle,
    LoadFailed,
    Ready,
    Refused,
    Report,
    ResetPrefixCache,
    Shutdown,
    StepDone,
    StepFailed,
)
from kvscale.server.sampling_params import SamplingParams

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # how long shutdown waits for the engine process before killing it
DEFAULT_STALL_TIMEOUT_S = 30.0  # no word from the engine this long: it is stalled
TEXT_WORKERS = 2  # threads tokenizing, rendering templates and detokenizing whole prompts


class EngineDeadError(RuntimeError):
    """The engine is not running (not started, stopped, or its process died)."""


class EngineStalledError(EngineDeadError):
    """The engine process has not answered for longer than ``stall_timeout`` (stopped,
    swapping, wedged in a step): new requests are refused and those in flight fail."""


class ServerShutdownError(EngineDeadError):
    """The server is exiting before this request could finish (drain timeout, or a second
    SIGTERM)."""


class EngineStepError(RuntimeError):
    """A model step failed; every request that was in flight fails with this."""


class QueueFullError(RuntimeError):
    """Admitting the request would leave more than ``max_queue_len`` sequences waiting."""

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(
            f"the server is at capacity: {num_waiting} sequences would wait for a free slot "
            f"(max_queue_len={limit}); retry later"
        )
        self.num_waiting = num_waiting
        self.limit = limit


class EngineObserver(Protocol):
    """Called on the event loop; used for the latency histograms."""

    def on_add(self, request_id: str, arrival_time: float) -> None: ...

    def on_step(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


@dataclass
class EngineRequest:
    """One engine request: a tokenized prompt, its sampling settings and its prefix-cache
    salt (requests share cached KV blocks only with requests of the same salt)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class RequestGroup:
    """The outputs of one or more engine requests submitted together (n prompts).

    ``async for out in group`` yields RequestOutputs (cumulative, so outputs the consumer
    had no time to read are skipped: only the latest state of each request is kept)
    until every request finished. Always ``close()`` it (or use ``async with``): that
    aborts unfinished requests.
    """

    def __init__(self, engine: AsyncEngine, request_ids: Sequence[str]) -> None:
        self._engine = engine
        self.request_ids = list(request_ids)
        self._unfinished = set(self.request_ids)
        self._latest: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self._closed = False

    # ---- called on the event loop by AsyncEngine ----------------------------------------
    def _put(self, request_id: str, payload: RequestOutput | BaseException) -> None:
        if isinstance(payload, BaseException):
            self._error = payload
            self._unfinished.discard(request_id)
        else:
            self._latest[request_id] = payload
        self._wakeup.set()

    # ---- consumer API --------------------------------------------------------------------
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
        self._wakeup.set()

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncEngine:
    """Owns the engine process. Create it anywhere (it loads the tokenizer); ``start``
    and use it from one event loop."""

    def __init__(
        self,
        config: EngineConfig,
        max_queue_len: int | None = None,
        observer: EngineObserver | None = None,
        log_level: str = "INFO",
        process_target: Callable[..., None] = run_engine_process,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.process_target = process_target  # the engine process's entry point
        self.max_queue_len = max_queue_len
        self.observer = observer
        self.log_level = log_level
        self.stall_timeout = stall_timeout  # seconds without a word from the engine
        self.stalled = False
        self._closing: str | None = None  # why new requests are refused (shutting down)
        self._text_pool = ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="kvscale-text")
        self.resolved, self.tokenizer = config.load()
        self.model_config = self.resolved.model
        self.max_model_len = self.resolved.max_model_len
        self.processor = OutputProcessor(self.tokenizer, stream=True)
        self.info: dict[str, Any] = {}
        self.heartbeat = time.monotonic()
        self.num_step_errors = 0
        self._stats: EngineStats | None = None
        self._pending_seqs = 0  # sequences sent to the engine, not yet reported queued
        self._groups: dict[str, RequestGroup] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._conn: Connection | None = None  # commands to the engine (sender thread)
        self._transport: asyncio.BaseTransport | None = None  # the engine's outputs
        self._first: asyncio.Future[Report | None] | None = None
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._running = False
        # called on the event loop, once, when a started engine dies (with the reason:
        # its process exited, or it reported a rank's failure)
        self.on_dead: Callable[[str], None] | None = None
        self.fatal_reason: str | None = None

    # ---- read-only helpers ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def tokenize(self, text: str) -> list[int]:
        """A prompt's token ids, as the engine would tokenize it (BOS included)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)`` on the text threads: tokenizing, rendering a chat template or
        detokenizing a whole prompt takes time proportional to its (client-chosen) size and
        must not stall the event loop, which serves every other stream and the probes
        (the Rust tokenizer releases the GIL)."""
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Starts the engine process and waits until its model is loaded; returns its
        info (device, dtype, KV blocks...). Raises RuntimeError if loading failed."""
        loop = self._loop = asyncio.get_running_loop()
        ctx = mp.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=self.process_target,
            args=(self.resolved, cmd_recv, out_send, self.log_level),
            name="kvscale-engine",
            daemon=True,
        )
        self._proc.start()
        cmd_recv.close()
        out_send.close()  # the engine's copy is the only writer: EOF when it exits
        self._conn = cmd_send
        self._first = loop.create_future()
        pipe = os.fdopen(os.dup(out_recv.fileno()), "rb", buffering=0)
        out_recv.close()
        try:
            self._transport, _ = await loop.connect_read_pipe(
                lambda: MessageProtocol(self._on_message, self._on_pipe_closed), pipe
            )
            msg = await self._first
            if msg is None:  # the pipe closed before a word
                await asyncio.to_thread(self._proc.join, STOP_TIMEOUT_S)
                msg = LoadFailed(
                    f"the engine process exited (code {self._proc.exitcode}) while loading"
                )
        except BaseException:
            self.shutdown(timeout=1.0)
            raise
        if not isinstance(msg, Ready):
            self.shutdown(timeout=1.0)
            raise RuntimeError(msg.message if isinstance(msg, LoadFailed | Fatal) else repr(msg))
        self.info = msg.info
        self._stats = msg.stats
        self.heartbeat = time.monotonic()
        self._running = True
        threading.Thread(target=self._send_loop, name="kvscale-engine-tx", daemon=True).start()
        return self.info

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stops the engine process (in-flight requests fail with EngineDeadError)."""
        started, self._running = self._running, False
        proc = self._proc
        if proc is None:
            return
        if started:  # the sender thread says it, after what is already queued
            self._outbox.put(Shutdown())
            self._outbox.put(None)
        elif self._conn is not None:
            try:
                self._conn.send(Shutdown())
            except OSError:
                pass
        proc.join(timeout)
        if proc.is_alive():
            log.warning("the engine process did not stop in %.0fs; killing it", timeout)
            proc.kill()
            proc.join(5)
        if self._transport is not None:
            self._transport.close()
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    def is_alive(self) -> bool:
        """True while the engine process runs and its pipe is open."""
        return self._running and self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        """The engine process's id (for operators and tests)."""
        return None if self._proc is None else self._proc.pid

    def seconds_since_heartbeat(self) -> float:
        """Seconds since the engine last reported (each step, or once a second idle)."""
        return time.monotonic() - self.heartbeat

    def check_stall(self) -> bool:
        """Call periodically on the event loop. An engine that has said nothing for
        ``stall_timeout`` seconds (it reports after every step and once a second when idle)
        is stalled: the requests in flight fail with ``EngineStalledError`` (rather than
        hang) and new ones are refused until it speaks again. Returns ``stalled``."""
        silent = self.seconds_since_heartbeat()
        if self._running and not self.stalled and silent > self.stall_timeout:
            self.stalled = True
            rids = list(self.processor.requests)
            log.error(
                "the engine process has not answered for %.0fs (stall timeout %.0fs); "
                "failing %d request(s) in flight",
                silent,
                self.stall_timeout,
                len(rids),
            )
            self._fail(rids, EngineStalledError(self._stall_message()), abort=True)
        return self.stalled

    def _stall_message(self) -> str:
        return (
            f"the engine has not answered for {self.seconds_since_heartbeat():.0f}s "
            f"(stall timeout {self.stall_timeout:g}s); retry later"
        )

    def close_for_shutdown(self, reason: str) -> int:
        """Refuses new requests and fails those in flight with ``ServerShutdownError`` (their
        streams end with an error event); returns how many requests were cut."""
        self._closing = reason
        rids = list(self.processor.requests)
        groups = {id(self._groups[r]) for r in rids if r in self._groups}
        self._fail(rids, ServerShutdownError(f"the server is shutting down ({reason})"), True)
        return len(groups)

    def stats(self) -> EngineStats:
        """The latest snapshot, with finished counts from the output side."""
        s = self._stats
        if s is None:
            raise EngineDeadError("the engine has not started")
        return replace(s, finished=dict(self.processor.finished))

    @property
    def num_waiting(self) -> int:
        """Sequences waiting in the engine plus those sent but not yet queued there."""
        return (self._stats.num_waiting if self._stats else 0) + self._pending_seqs

    # ---- requests (on the event loop) ----------------------------------------------------
    def submit(
        self, requests: Sequence[EngineRequest], arrival_time: float | None = None
    ) -> RequestGroup:
        """Validates and queues requests; returns their group at once.

        Raises InvalidRequestError for bad input, EngineDeadError if the engine is not
        running and QueueFullError if ``max_queue_len`` sequences are already waiting;
        nothing is queued then.
        """
        if self._closing is not None:
            raise ServerShutdownError(f"the server is shutting down ({self._closing})")
        if not self.is_alive():
            raise EngineDeadError("the engine is not running")
        if self.stalled:
            raise EngineStalledError(self._stall_message())
        rids = [r.request_id for r in requests]
        if len(set(rids)) != len(rids) or any(r in self._groups for r in rids):
            raise InvalidRequestError("request ids must be unique")
        for r in requests:
            validate_request(r.prompt_token_ids, r.params, self.vocab_size, self.max_model_len)
        self._admit(sum(r.params.n for r in requests))
        group = RequestGroup(self, rids)
        now = time.monotonic() if arrival_time is None else arrival_time
        for r in requests:
            self._groups[r.request_id] = group
            self.processor.add(r.request_id, None, r.prompt_token_ids, r.params, now)
            self._pending_seqs += r.params.n
            self._outbox.put(
                AddRequest(r.request_id, r.prompt_token_ids, r.params, now, r.cache_salt)
            )
            if self.observer is not None:
                self.observer.on_add(r.request_id, now)
        return group

    def queued_after(self, num_seqs: int) -> int:
        """Sequences that would wait for a batch slot if ``num_seqs`` more arrived now: the
        engine's waiting ones, those sent but not yet counted there, and the new ones,
        less the free slots of the running batch (none while sequences already wait: the
        engine then lacks KV blocks, not slots)."""
        s = self._stats
        running = s.num_running if s else 0
        waiting = s.num_waiting if s else 0
        free = 0 if waiting else max(0, int(self.config.max_num_seqs) - running)
        return max(0, waiting + self._pending_seqs + num_seqs - free)

    def _admit(self, num_seqs: int) -> None:
        """``max_queue_len``: refuses a request whose sequences (``n`` each) would make more
        than that many wait; sequences that start at once do not count."""
        limit = self.max_queue_len
        if limit is None:
            return
        capacity = int(self.config.max_num_seqs) + limit
        if num_seqs > capacity:
            raise InvalidRequestError(
                f"this request asks for {num_seqs} sequences (prompts x n), more than this "
                f"server can ever admit at once ({capacity}: max_num_seqs "
                f"{self.config.max_num_seqs} + max_queue_len {limit})",
                param="n",
            )
        queued = self.queued_after(num_seqs)
        if queued > limit:
            raise QueueFullError(queued, limit)

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> _Generate:
        """``async for out in engine.generate(...)``: one request; aborts when closed early."""
        return _Generate(self, EngineRequest(request_id, prompt_token_ids, params))

    def abort(self, request_id: str) -> None:
        """Drops a request (no-op if it already finished)."""
        if self.processor.abort(request_id):
            self._outbox.put(AbortRequest(request_id))
            if self.observer is not None:
                self.observer.on_abort(request_id)

    def reset_prefix_cache(self) -> None:
        """Asks the engine to forget its cached prefix blocks (takes effect in order with
        the requests already sent)."""
        if not self.is_alive():
            raise EngineDeadError("the engine is not running")
        self._outbox.put(ResetPrefixCache())

    def _groups_remove(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._groups.pop(rid, None)

    def _deliver(self, events: list[tuple[str, RequestOutput | BaseException]]) -> None:
        for rid, payload in events:
            group = self._groups.get(rid)
            if group is not None:
                group._put(rid, payload)

    # ---- messages from the engine (on the event loop) -------------------------------------
    def _on_message(self, msg: Report) -> None:
        if self._first is not None and not self._first.done():
            self._first.set_result(msg)  # Ready or LoadFailed
            return
        self.heartbeat = time.monotonic()
        if self.stalled:
            self.stalled = False
            log.warning("the engine process answers again")
        match msg:
            case StepDone(updates, stats, now, added):
                self._on_report(stats, added)
                self._on_updates(updates, now)
            case Idle(stats, _, added):
                self._on_report(stats, added)
            case StepFailed(rids, message):
                self.num_step_errors += 1
                self._fail(rids, EngineStepError(message))
            case Refused(rid, message):
                self._fail([rid], EngineStepError(f"cannot queue request: {message}"))
            case Fatal(message):
                log.error("the engine failed: %s", message)
                self._on_engine_dead(message)
            case _:
                log.error("unexpected message from the engine process: %r", msg)

    def _on_report(self, stats: EngineStats, added: int) -> None:
        self._stats = stats
        self._pending_seqs = max(0, self._pending_seqs - added)

    def _on_updates(self, updates: list[SeqUpdate], now: float) -> None:
        outputs, stopped = self.processor.process(updates, now)
        for rid, index in stopped:
            self._outbox.put(FinishSequence(rid, index))
        if self.observer is not None:
            try:
                self.observer.on_step(outputs, time.monotonic())
            except Exception:
                log.exception("metrics observer failed")
        self._deliver([(out.request_id, out) for out in outputs])

    def _fail(self, rids: Sequence[str], error: BaseException, abort: bool = False) -> None:
        """Fails requests with ``error``; ``abort``: also tell the engine to drop them."""
        for rid in rids:
            if self.processor.abort(rid):
                if abort and self._running:
                    self._outbox.put(AbortRequest(rid))
                if self.observer is not None:
                    self.observer.on_abort(rid)
        self._deliver([(rid, error) for rid in rids])

    def _on_engine_dead(self, reason: str | None = None) -> None:
        was_running, self._running = self._running, False
        if reason is not None and self.fatal_reason is None:
            self.fatal_reason = reason
        message = f"the engine stopped: {self.fatal_reason}" if self.fatal_reason else None
        self._fail(list(self.processor.requests), EngineDeadError(message or "the engine stopped"))
        if was_running and self.fatal_reason and self.on_dead is not None:
            self.on_dead(self.fatal_reason)

    # ---- the pipes ---------------------------------------------------------------------
    def _on_pipe_closed(self) -> None:
        """On the event loop: the engine's output pipe closed (the process exited)."""
        if self._first is not None and not self._first.done():
            self._first.set_result(None)
            return
        reason = None
        if self._running:
            self._proc.join(1.0)  # it closed its pipe by exiting: learn how
            reason = f"the engine process exited unexpectedly (exit code {self._proc.exitcode})"
            log.error("%s", reason)
        self._on_engine_dead(reason)

    def _send_loop(self) -> None:
        """The sender thread: writes queued commands (blocking) until ``None``."""
        conn = self._conn
        assert conn is not None
        while (msg := self._outbox.get()) is not None:
            try:
                conn.send(msg)
            except OSError as e:  # the engine is gone; the output pipe reports that
                log.warning("cannot send to the engine process: %s", e)
                return


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
            return await self._group.__anext__()
        except BaseException:  # StopAsyncIteration, errors, cancellation
            self._group.close()
            raise

    async def aclose(self) -> None:
        if self._group is not None:
            self._group.close()
