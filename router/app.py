"""The proxy: an ASGI app in front of a ``Pool`` of replicas.

Each request's body is read whole (the routing key needs the prompt), then sent unchanged
to the chosen replica; the response's status, headers (less hop-by-hop ones) and raw body
bytes come back chunk by chunk as they arrive. A refused or reset connection before the
first response byte is retried on another replica; nothing is retried once bytes were
sent (a replica failing mid-response closes the client's connection, so that it sees an
incomplete response). A client that disconnects cancels the upstream request (its
connection is closed, which the server takes as an abort). While no replica is ready,
requests are held (``--hold-queue-size``, ``--hold-timeout``), then answered 503 with
``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from kvscale.router.balance import (
    DEFAULT_EPSILON,
    DEFAULT_KV_THRESHOLD,
    DEFAULT_VNODES,
    choose,
    prefix_key,
)
from kvscale.router.endpoints import EndpointSource, Pool, Replica
from kvscale.router.metrics import RouterMetrics
from kvscale.router.prompt import PromptTokenizer, parse_body, prompt_token_ids, request_salt
from kvscale.server.api.app import _authorized
from kvscale.server.api.errors import error_response, unauthorized_response

log = logging.getLogger("kvscale.router")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Idle upstream connections are dropped after this many seconds, before the replicas'
# keep-alive (5 s in uvicorn, kvscale serve and vLLM) closes them under a request.
UPSTREAM_KEEPALIVE_S = 4.0
# Failures of an attempt that sent nothing back: safe to send the request elsewhere.
# (A refused connection also takes the replica out of the rotation until /ready says 200.)
BEFORE_FIRST_BYTE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)


@dataclass
class RouterSettings:
    policy: str = "prefix"  # prefix | least-loaded | random
    block_size: int = 16  # the engine's --block-size
    prefix_blocks: int = 4  # leading full blocks hashed into the routing key
    epsilon: float = DEFAULT_EPSILON
    kv_threshold: float = DEFAULT_KV_THRESHOLD
    vnodes: int = DEFAULT_VNODES
    scrape_interval: float = 1.0  # seconds between polls of /ready and /metrics
    scrape_timeout: float = 5.0
    connect_timeout: float = 5.0
    hold_queue_size: int = 256  # requests held at most while no replica is ready
    hold_timeout: float = 30.0  # seconds a request may be held
    retry_after: int = 1  # the 503's Retry-After (seconds)
    max_body_bytes: int = 64 << 20  # larger request bodies get 413 (0: no limit)
    api_key: str | None = None
    prefix_cache_salt_per_key: bool = False
    seed: int | None = None  # of the random policy (tests)


class RouterApp:
    """``RouterApp(settings, source, tokenizer)``: an ASGI app (with lifespan)."""

    def __init__(
        self,
        settings: RouterSettings,
        source: EndpointSource,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        if settings.policy not in ("prefix", "least-loaded", "random"):
            raise ValueError(f"unknown policy {settings.policy!r}")
        self.s = settings
        self.source = source
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.pool = Pool(settings.vnodes, self._ready_changed)
        self.rng = random.Random(settings.seed)
        self.client: httpx.AsyncClient | None = None
        self.held = 0
        self._tasks: list[asyncio.Task[Any]] = []

    # ---- lifecycle ----------------------------------------------------------------------
    def _ready_changed(self, url: str, ready: bool) -> None:
        self.metrics.replica_ready.labels(url).set(1 if ready else 0)

    async def startup(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.s.connect_timeout),
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=256,
                keepalive_expiry=UPSTREAM_KEEPALIVE_S,
            ),
        )
        self._tasks = [
            asyncio.create_task(self.source.run(self.pool.update)),
            asyncio.create_task(
                self.pool.poll_forever(self.client, self.s.scrape_interval, self.s.scrape_timeout)
            ),
        ]

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        if self.client is not None:
            await self.client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            resp: Response = JSONResponse({"status": "ok"})
        elif path == "/ready":
            ready = len(self.pool.ready())
            resp = JSONResponse({"status": "ready", "replicas_ready": ready, "held": self.held})
        elif path == "/metrics":
            self.metrics.observe_replicas(self.pool.replicas.values())
            resp = Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        else:
            await self._proxy(scope, receive, send)
            return
        await resp(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- proxying -----------------------------------------------------------------------
    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.s.api_key
        if key and scope["path"].startswith("/v1") and not _authorized(scope, key):
            resp = unauthorized_response()
            await resp(scope, receive, send)
            return
        self.metrics.last_request.set_to_current_time()
        request = Request(scope, receive)
        body = await self._read_body(request, scope, send)
        if body is None:
            return
        routing_key = await self._routing_key(request, body)
        # The client's disconnect (the only message left to receive) cancels the exchange.
        work = asyncio.create_task(self._exchange(scope, send, body, routing_key))
        watch = asyncio.create_task(_disconnected(receive))
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
        else:
            watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        try:
            await work
        except asyncio.CancelledError:
            if not watch.cancelled():
                return  # the client disconnected: counted by _exchange
            raise

    async def _read_body(self, request: Request, scope: Scope, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 (over ``max_body_bytes``) or when
        the client went away while sending it."""
        limit = self.s.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_large = bool(limit and declared.isdigit() and int(declared) > limit)
        buf = bytearray()
        if not too_large:
            try:
                async for chunk in request.stream():
                    buf += chunk
                    if limit and len(buf) > limit:
                        too_large = True
                        break
            except Exception:  # the client went away while sending
                return None
        if too_large:
            resp = error_response(
                413,
                f"the request body is larger than {limit} bytes",
                code="request_too_large",
                headers={"Connection": "close"},
            )
            await resp(scope, _no_receive, send)
            return None
        return bytes(buf)

    async def _routing_key(self, request: Request, body: bytes) -> bytes | None:
        if self.s.policy != "prefix" or request.method != "POST":
            return None
        obj = parse_body(body)
        if obj is None:
            return None
        path = request.url.path
        if self.tokenizer is None:  # token-id prompts only
            ids = prompt_token_ids(path, obj, None)
        else:
            ids = await asyncio.to_thread(prompt_token_ids, path, obj, self.tokenizer)
        if not ids:
            return None
        salt = request_salt(obj, request, self.s.prefix_cache_salt_per_key)
        return prefix_key(ids, self.s.block_size, self.s.prefix_blocks, salt)

    async def _exchange(self, scope: Scope, send: Send, body: bytes, key: bytes | None) -> None:
        """Chooses, holds, retries, and relays one request."""
        tried: set[str] = set()
        held_since: float | None = None
        while True:
            choice = choose(
                self.s.policy,
                key,
                self.pool.ring,
                self.pool.ready(),
                epsilon=self.s.epsilon,
                kv_threshold=self.s.kv_threshold,
                exclude=frozenset(tried),
                rng=self.rng,
            )
            if choice is None:
                if held_since is None:
                    if self.held >= self.s.hold_queue_size:
                        await self._unavailable(scope, send, "the hold queue is full")
                        return
                    held_since = time.monotonic()
                left = held_since + self.s.hold_timeout - time.monotonic()
                if left <= 0:
                    self.metrics.hold_time.observe(time.monotonic() - held_since)
                    await self._unavailable(scope, send, "no replica became ready in time")
                    return
                self.held += 1
                self.metrics.held.set(self.held)
                try:
                    await self.pool.wait_change(left)
                finally:
                    self.held -= 1
                    self.metrics.held.set(self.held)
                tried.clear()  # readiness changed: a refused replica may be back
                continue
            if held_since is not None:
                self.metrics.hold_time.observe(time.monotonic() - held_since)
                held_since = None
            self.metrics.decisions.labels(choice.reason).inc()
            self.metrics.load_ratio.observe((choice.load + 1) / max(1, choice.bound))
            replica = self.pool.replicas[choice.replica]
            others = set(self.pool.ready()) - tried - {replica.url}
            if await self._attempt(replica, scope, send, body, last_resort=not others):
                return
            tried.add(replica.url)
            self.metrics.retries.inc()

    async def _attempt(
        self, replica: Replica, scope: Scope, send: Send, body: bytes, last_resort: bool
    ) -> bool:
        """One try at ``replica``: False if it failed before any response byte (the
        caller tries another), True once a response was relayed (or failed midway). A 503
        (a draining or stalled server, whose /ready the last poll still saw at 200) takes
        the replica out of the rotation and is tried elsewhere, unless ``last_resort``."""
        assert self.client is not None
        url = replica.url + scope["raw_path"].decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [
            (k, v)
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in HOP_BY_HOP | {"host", "content-length"}
        ]
        req = self.client.build_request(scope["method"], url, headers=headers, content=body)
        gauge = self.metrics.inflight.labels(replica.url)
        replica.inflight += 1
        gauge.set(replica.inflight)
        outcome = "upstream_error"
        try:
            try:
                resp = await self.client.send(req, stream=True)
            except BEFORE_FIRST_BYTE as e:
                self.metrics.upstream_errors.labels(replica.url, "connect").inc()
                log.warning("replica %s failed before responding: %r", replica.url, e)
                if isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
                    self.pool.set_ready(replica.url, False)  # back when /ready says so
                outcome = ""
                return False
            if resp.status_code == 503 and not last_resort:
                await resp.aclose()
                self.metrics.upstream_errors.labels(replica.url, "unavailable").inc()
                log.warning("replica %s answered 503: out of the rotation", replica.url)
                self.pool.set_ready(replica.url, False)
                outcome = ""
                return False
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": resp.status_code,
                        "headers": [
                            (k, v)
                            for k, v in resp.headers.raw
                            if k.decode("latin-1").lower() not in HOP_BY_HOP
                        ],
                    }
                )
                try:
                    async for chunk in resp.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.HTTPError:
                    self.metrics.upstream_errors.labels(replica.url, "midstream").inc()
                    raise
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                outcome = f"{resp.status_code // 100}xx"
            finally:
                await resp.aclose()
            return True
        except asyncio.CancelledError:
            # The client may close as soon as it has the last byte, while aclose() runs:
            # a response relayed in full keeps its status outcome.
            if outcome == "upstream_error":
                outcome = "client_disconnect"
            raise
        finally:
            replica.inflight -= 1
            gauge.set(replica.inflight)
            if outcome:
                self.metrics.requests.labels(replica.url, outcome).inc()

    async def _unavailable(self, scope: Scope, send: Send, why: str) -> None:
        self.metrics.requests.labels("", "no_replica").inc()
        resp = error_response(
            503,
            f"no replica is ready: {why}",
            code="no_replica_ready",
            headers={"Retry-After": str(self.s.retry_after)},
        )
        await resp(scope, _no_receive, send)


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
