"""The FastAPI application: OpenAI routes, health, readiness, metrics.

``create_app(settings, engine_factory)`` returns an app whose lifespan starts the engine
process and waits for its model to load (the server answers ``/health`` meanwhile), runs
one short warm-up generation and only then reports ``/ready``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from kvscale import __version__
from kvscale.server.api.errors import (
    APIError,
    error_response,
    install_error_handlers,
    unauthorized_response,
)
from kvscale.server.api.http_limits import BodyLimit
from kvscale.server.api.lifecycle import Lifecycle
from kvscale.server.api.metrics import ServerMetrics
from kvscale.server.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kvscale.server.api.serving_chat import create_chat_completion
from kvscale.server.api.serving_completions import create_completion
from kvscale.server.api.serving_tokenize import detokenize, tokenize
from kvscale.server.api.state import ServerSettings, ServerState
from kvscale.server.engine.core_outputs import EngineStats
from kvscale.server.process.async_engine import AsyncEngine
from kvscale.server.sampling_params import SamplingParams

log = logging.getLogger("kvscale.server")

T = TypeVar("T")

HEARTBEAT_TIMEOUT_S = 120.0  # /health fails if one engine iteration takes longer than this
STATS_LOG_INTERVAL_S = 10.0  # how often a busy server logs its load
WATCHDOG_INTERVAL_S = 0.5  # how often the engine's heartbeat is checked
WARMUP_PROMPT = "Hello, my name is"
WARMUP_TOKENS = 4
WARMUP_PREFIX = 48  # the first warm-up prompt's tokens: whole blocks for the second to share


class Gate:
    """ASGI middleware for ``/v1/*``: 503 while draining, API-key check, in-flight count."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        lc, key = self.state.lifecycle, self.state.settings.api_key
        if lc.draining:
            resp = error_response(
                503, "the server is shutting down", code="draining", headers={"Connection": "close"}
            )
            await resp(scope, receive, send)
            return
        if key and not _authorized(scope, key):
            resp = unauthorized_response()
            await resp(scope, receive, send)
            return
        lc.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            lc.inflight -= 1


def _authorized(scope: Scope, key: str) -> bool:
    """Whether the request carries ``Authorization: Bearer <key>``. Bytes are compared with
    bytes (the key as UTF-8, the header as sent), in constant time, so a non-ASCII key
    matches a client sending it in UTF-8."""
    want = key.encode("utf-8")
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), want):
                return True
    return False


async def _in_daemon_thread(fn: Callable[[], T]) -> T:
    """Runs a blocking call in a daemon thread (never blocks process exit)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            fut.set_result(value) if ok else fut.set_exception(value)

    def run() -> None:
        try:
            result: Any = (True, fn())
        except BaseException as e:
            result = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # loop closed: the server is gone
            pass

    threading.Thread(target=run, name="kvscale-load", daemon=True).start()
    return await fut


def _subtract(s: EngineStats, base: EngineStats | None) -> EngineStats:
    """Counters net of the warm-up request, so /metrics counts client traffic only."""
    if base is None:
        return s
    finished = {k: v - base.finished.get(k, 0) for k, v in s.finished.items()}
    return dataclasses.replace(
        s,
        prompt_tokens=s.prompt_tokens - base.prompt_tokens,
        generation_tokens=s.generation_tokens - base.generation_tokens,
        num_preemptions=s.num_preemptions - base.num_preemptions,
        finished={k: v for k, v in finished.items() if v},
        spec_num_drafts=s.spec_num_drafts - base.spec_num_drafts,
        spec_num_draft_tokens=s.spec_num_draft_tokens - base.spec_num_draft_tokens,
        spec_num_accepted_tokens=s.spec_num_accepted_tokens - base.spec_num_accepted_tokens,
        # one engine: the same length (k) in both snapshots, or empty without speculation
        spec_accepted_per_pos=[
            a - b for a, b in zip(s.spec_accepted_per_pos, base.spec_accepted_per_pos, strict=False)
        ],
        spec_draft_failures=s.spec_draft_failures - base.spec_draft_failures,
    )


async def _warm_up(aeng: AsyncEngine) -> None:
    """Runs the step shapes serving meets first: a prompt's prefill and decode, then,
    while it decodes, a prompt sharing its full blocks (a prefill on cached context)
    beside a fresh one, in mixed steps with two and three rows. On a GPU the kernels of
    each new shape compile (Triton: one compilation per specialization, seconds on a cold
    cache) here rather than in the first users' requests (NOTES e35). Greedy, a few
    tokens each; prompts made of the warm-up prompt's token ids."""
    params = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    base = aeng.tokenize(WARMUP_PROMPT)
    cap = max(1, aeng.max_model_len - WARMUP_TOKENS)  # a prompt's most tokens
    first = (base * (WARMUP_PREFIX // max(1, len(base)) + 1))[: min(WARMUP_PREFIX, cap)]

    async def run(request_id: str, ids: list[int]) -> None:
        async for _ in aeng.generate(request_id, ids, params):
            pass

    limit, aeng.max_queue_len = aeng.max_queue_len, None  # three at once whatever it is
    others: asyncio.Future[list[None]] | None = None
    try:
        lead = aeng.generate("warmup-0", first, params).__aiter__()
        await lead.__anext__()  # prefilled: its full blocks are cached
        shared, fresh = (first + base)[:cap], base[::-1][:cap]
        others = asyncio.gather(run("warmup-1", shared), run("warmup-2", fresh))
        async for _ in lead:
            pass
        await others
    finally:
        aeng.max_queue_len = limit
        if others is not None and not others.done():
            others.cancel()


async def _start_engine(state: ServerState, factory: Callable[[], AsyncEngine]) -> None:
    lc, settings = state.lifecycle, state.settings
    aeng: AsyncEngine | None = None
    try:
        t0 = time.perf_counter()
        log.info("[1/3] loading model %s ...", settings.model_path or settings.model_name)
        aeng = await _in_daemon_thread(factory)
        aeng.max_queue_len = settings.max_queue_len
        aeng.stall_timeout = settings.engine_stall_timeout
        # an engine that dies (its process, or a tensor-parallel rank) exits the server
        aeng.on_dead = lambda reason: _engine_died(state, reason)
        info = await aeng.start()
        log.info(
            "[2/3] model loaded in %.1fs: %s on %s, %s, max_model_len %d, KV cache %d blocks "
            "x %d tokens, max_num_seqs %d, cuda_graph_max_batch %d",
            time.perf_counter() - t0,
            info["architecture"],
            info["device"],
            info["dtype"],
            aeng.max_model_len,
            info["num_kv_blocks"],
            info["block_size"],
            aeng.config.max_num_seqs,
            aeng.config.cuda_graph_max_batch,
        )
        state.engine = aeng
        base: list[EngineStats | None] = [None]
        state.metrics.bind_stats(lambda: (_subtract(aeng.stats(), base[0]), aeng.num_waiting))
        lc.loaded = True
        if settings.warmup:
            t1 = time.perf_counter()
            log.info("[3/3] warming up ...")
            await _warm_up(aeng)
            log.info("[3/3] warm-up done in %.2fs", time.perf_counter() - t1)
        base[0] = aeng.stats()
        aeng.observer = state.metrics.timer
        # What start-up made (modules, the app, the tokenizer, the engine client) lives as
        # long as the server: out of the collector's sight, its full passes (which the
        # many short-lived objects of streaming trigger) no longer walk it (NOTES e32).
        gc.collect()
        gc.freeze()
        lc.warmed_up = True
        log.info("ready: serving %s", ", ".join(settings.served_model_names))
    except asyncio.CancelledError:
        if aeng is not None and state.engine is None:
            aeng.shutdown(timeout=1.0)
        raise
    except Exception as e:
        log.error("start-up failed: %s: %s", type(e).__name__, e)
        if aeng is not None:
            aeng.shutdown(timeout=1.0)
        lc.fail(f"{type(e).__name__}: {e}")


def _engine_died(state: ServerState, reason: str) -> None:
    """The engine is gone: its requests already failed with an error; exit non-zero
    now, so Kubernetes restarts the pod (instead of a live process serving nothing and
    reporting its last gauges)."""
    state.metrics.bind_stats(lambda: None)  # no ghost gauges until the process is gone
    state.lifecycle.fail(f"the engine failed: {reason}")


async def _watchdog(state: ServerState) -> None:
    """Fails requests (and readiness) while the engine is silent (see ``check_stall``)."""
    while True:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if state.engine is not None:
            state.engine.check_stall()


def _cut_requests(state: ServerState, reason: str) -> int:
    """Forced shutdown: every request in flight ends now with an error (streams get an
    error event and ``[DONE]``); returns how many HTTP requests were in flight."""
    if state.engine is not None:
        state.engine.close_for_shutdown(reason)
    return state.lifecycle.inflight


async def _log_stats(state: ServerState) -> None:
    last: EngineStats | None = None
    last_t = time.monotonic()
    while True:
        await asyncio.sleep(STATS_LOG_INTERVAL_S)
        eng = state.engine
        if eng is None:
            continue
        s, now = eng.stats(), time.monotonic()
        if last is not None and (
            s.generation_tokens != last.generation_tokens or s.num_running or s.num_waiting
        ):
            dt = max(now - last_t, 1e-9)
            log.info(
                "running %d, waiting %d, KV cache %.1f%% used, prompt %.1f tok/s, "
                "generation %.1f tok/s",
                s.num_running,
                eng.num_waiting,
                100 * s.kv_cache_usage,
                (s.prompt_tokens - last.prompt_tokens) / dt,
                (s.generation_tokens - last.generation_tokens) / dt,
            )
        last, last_t = s, now


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The schema, with our 400 in place of FastAPI's 422 (we never answer 422)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for op in path.values():
                responses = op.get("responses", {})
                if "422" in responses:
                    del responses["422"]
                    responses["400"] = {
                        "description": "Invalid request (OpenAI error shape)",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorResponse"}
                            }
                        },
                    }
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    return build


def create_app(settings: ServerSettings, engine_factory: Callable[[], AsyncEngine]) -> FastAPI:
    """The ASGI app. ``engine_factory`` builds the (not yet started) AsyncEngine; it runs
    in a thread, since it may build the demo checkpoint and loads the tokenizer."""
    state = ServerState(
        settings=settings,
        lifecycle=Lifecycle(settings.drain_timeout),
        metrics=ServerMetrics(settings.model_name),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(_start_engine(state, engine_factory)),
            asyncio.create_task(_log_stats(state)),
            asyncio.create_task(_watchdog(state)),
        ]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            if state.engine is not None:
                await asyncio.to_thread(state.engine.shutdown, 10.0)

    app = FastAPI(
        title="kvscale",
        version=__version__,
        description="OpenAI-compatible LLM inference server",
        lifespan=lifespan,
    )
    app.state.server = state
    state.lifecycle.cut = lambda reason: _cut_requests(state, reason)
    install_error_handlers(app)
    app.add_middleware(Gate, state=state)
    app.add_middleware(BodyLimit, limit=state.body_limit)  # outermost: before any reading
    errors: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorResponse} for code in (401, 404, 429, 503)
    }

    @app.get("/health", tags=["lifecycle"])
    async def health() -> JSONResponse:
        """Liveness: 200 while the engine loop is alive (or the model is still loading)."""
        lc, eng = state.lifecycle, state.engine
        if lc.fatal_error:
            return JSONResponse({"status": "failed", "reason": lc.fatal_error}, 503)
        if eng is None:
            return JSONResponse({"status": "loading"})
        if not eng.is_alive():
            return JSONResponse({"status": "dead", "reason": "engine loop stopped"}, 503)
        stale = eng.seconds_since_heartbeat()
        if stale > HEARTBEAT_TIMEOUT_S:
            return JSONResponse(
                {"status": "stuck", "reason": f"no engine iteration for {stale:.0f}s"}, 503
            )
        return JSONResponse({"status": "ok"})

    @app.get("/ready", tags=["lifecycle"])
    async def ready() -> JSONResponse:
        """Readiness: 200 once loaded and warmed up, 503 while loading or draining."""
        lc, eng = state.lifecycle, state.engine
        if lc.ready and eng is not None and eng.is_alive() and not eng.stalled:
            return JSONResponse({"status": "ready"})
        if lc.fatal_error:
            status = "failed"
        elif lc.draining:
            status = "draining"
        elif not lc.loaded:
            status = "loading"
        elif not lc.warmed_up:
            status = "warming_up"
        elif eng is not None and eng.is_alive() and eng.stalled:
            status = "engine_stalled"
        else:
            status = "engine_dead"
        return JSONResponse({"status": status}, 503)

    @app.get("/metrics", tags=["lifecycle"])
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache", tags=["lifecycle"])
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        """Forgets every cached prefix block (for benchmarks); needs the API key when one
        is set."""
        key = settings.api_key
        if key and not _authorized(request.scope, key):
            return error_response(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        state.require_engine().reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    @app.get("/version", tags=["lifecycle"])
    async def version() -> dict[str, str]:
        return {"version": __version__}

    def card(name: str) -> ModelCard:
        eng = state.engine
        return ModelCard(
            id=name,
            root=settings.model_path or None,
            max_model_len=eng.max_model_len if eng is not None else None,
        )

    @app.get("/v1/models", response_model=ModelList, tags=["openai"], responses=errors)
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in settings.served_model_names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, tags=["openai"], responses=errors)
    async def get_model(model: str) -> ModelCard:
        return card(state.check_model(model))

    @app.post(
        "/v1/completions",
        response_model=None,
        tags=["openai"],
        responses={200: {"model": CompletionResponse}, **errors},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Text completion; ``stream: true`` answers server-sent events."""
        return await create_completion(state, body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        tags=["openai"],
        responses={200: {"model": ChatCompletionResponse}, **errors},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Chat completion with the checkpoint's chat template; ``stream: true`` for SSE."""
        return await create_chat_completion(state, body, request)

    def check_key(request: Request) -> None:
        key = settings.api_key
        if key and not _authorized(request.scope, key):
            raise APIError(
                401,
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.post("/tokenize", response_model=TokenizeResponse, tags=["vllm"], responses=errors)
    async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        """vLLM's tokenizer endpoint: a prompt, or messages with the chat template."""
        check_key(request)
        return await tokenize(state, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, tags=["vllm"], responses=errors)
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        """vLLM's detokenizer endpoint: token ids to text."""
        check_key(request)
        return await detokenize(state, body)

    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app
