"""Limits on what one HTTP client may make the server hold: header size, slow headers or
bodies, and body size.

- ``limited_protocol(...)``: uvicorn's httptools protocol, plus a cap on the bytes of a
  request line and its headers (431 beyond it, as nginx's ``large_client_header_buffers``
  and Envoy's ``max_request_headers_kb`` do), a deadline for the headers to arrive
  (nginx's ``client_header_timeout``: a connection that opens and dribbles or sends nothing
  is closed with 408) and a deadline between two reads of a declared body (nginx's
  ``client_body_timeout``).
- ``BodyLimit``: ASGI middleware answering 413 for a body over the limit, before reading it
  when ``Content-Length`` says so, else as soon as the bytes received pass it. The limit is
  a callable, since its default derives from the model's context length, known only once
  the model is loaded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvscale.server.api.errors import error_response

log = logging.getLogger(__name__)

DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # request line + headers (Envoy's default is 60 KiB)
DEFAULT_HEADER_TIMEOUT_S = 30.0  # from connection (or the first byte of a request) to its headers
DEFAULT_BODY_TIMEOUT_S = 30.0  # longest silence while a declared body is arriving
BODY_BYTES_PER_TOKEN = 64  # default body limit: this many bytes per token of context ...
MIN_BODY_LIMIT = 1 << 20  # ... but at least 1 MiB (nginx's client_max_body_size default)


def default_body_limit(max_model_len: int) -> int:
    """The default ``--max-request-body-bytes``: room for a prompt filling the whole
    context as text (JSON-escaped, long tokens) or as token ids, and messages around it."""
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * max_model_len)


def _plain_response(status: int, reason: str, message: str) -> bytes:
    body = message.encode("ascii", "replace")
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii") + body


def limited_protocol(
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with header-size and read-timeout limits (pass it as
    ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_bytes = self._head_size = 0
            self._in_headers = True
            self._rejected = False
            self._timer: asyncio.TimerHandle | None = None
            self._arm(header_timeout_s, self._headers_too_slow)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        # ---- timers --------------------------------------------------------------------
        def _arm(self, delay: float, callback: Callable[[], None]) -> None:
            self._disarm()
            if delay > 0:
                self._timer = self.loop.call_later(delay, callback)

        def _disarm(self) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()  # type: ignore[union-attr]
                self._timer = None

        def _reject(self, status: int, reason: str, message: str) -> None:
            log.warning("closing a connection from %s: %s", self.client, message)
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is None or not cycle.response_started:
                self.transport.write(_plain_response(status, reason, message))
            self.transport.close()

        def _headers_too_slow(self) -> None:
            self._timer = None
            if self._in_headers and self._header_bytes:
                self._reject(408, "Request Timeout", "request headers not received in time")
            elif self._in_headers and not self.transport.is_closing():
                self.transport.close()  # opened and never used: nothing to answer

        def _body_too_slow(self) -> None:
            self._timer = None
            if self.flow is not None and self.flow.read_paused:
                # We stopped reading (the app has not consumed what came): not the client.
                self._arm(body_timeout_s, self._body_too_slow)
                return
            self._reject(408, "Request Timeout", "request body not received in time")

        def _too_large(self) -> None:
            self._rejected = True
            self._reject(
                431,
                "Request Header Fields Too Large",
                f"request line and headers exceed {max_header_bytes} bytes",
            )

        # ---- parser hooks --------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            if getattr(self, "_rejected", False):
                return
            counting = self._in_headers
            super().data_received(data)
            if counting and self._in_headers and not self._rejected:
                # Headers still incomplete after all of this: stop before they pile up.
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._too_large()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_size = 0
            if not self._in_headers:
                self._in_headers, self._header_bytes = True, 0
                self._arm(header_timeout_s, self._headers_too_slow)

        def on_url(self, url: bytes) -> None:
            self._head_size += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_size += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._disarm()
            if self._head_size > max_header_bytes:
                self._too_large()  # answered and closed; the app never sees the request
                return
            super().on_headers_complete()
            expects_body = self.parser.get_method() not in (b"GET", b"HEAD", b"OPTIONS")
            if expects_body and self.cycle is not None and self.cycle.more_body:
                self._arm(body_timeout_s, self._body_too_slow)

        def on_body(self, body: bytes) -> None:
            if self._rejected:
                return
            super().on_body(body)
            if self._timer is not None:
                self._arm(body_timeout_s, self._body_too_slow)

        def on_message_complete(self) -> None:
            self._disarm()
            if not self._rejected:
                super().on_message_complete()

    return LimitedHttpToolsProtocol


class BodyLimit:
    """ASGI middleware: 413 for request bodies over ``limit()`` bytes (None: no limit)."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int | None]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.limit() if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(limit, declared, scope, receive, send)
            return
        if declared is not None:  # the server reads no more than that: nothing to count,
            await self.app(scope, receive, send)  # and no wrapper on a stream's every send
            return
        received = 0
        started = refused = False

        async def counted_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Answer now (the app would turn any error while reading into a 400),
                    # then let the app see a client that went away.
                    refused = True
                    if not started:
                        await _too_large(limit, None, scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, tracked_send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _too_large(limit: int, size: int | None, scope: Scope, receive: Any, send: Send) -> None:
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes sent"
    resp = error_response(
        413,
        f"the request body is too large: {what}, the limit is {limit} bytes "
        "(--max-request-body-bytes; its default grows with --max-model-len)",
        code="request_too_large",
        headers={"Connection": "close"},
    )
    await resp(scope, receive, send)
