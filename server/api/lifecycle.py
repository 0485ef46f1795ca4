"""Readiness, in-flight accounting and graceful drain on SIGTERM.

``/ready`` is true once the model is loaded and warmed up, until a drain starts. On
SIGTERM the server starts draining at once: ``/ready`` answers 503, new API requests
get 503, requests in flight run to completion for up to ``drain_timeout`` seconds, then
uvicorn is told to exit and the process exits 0. This is what lets Kubernetes scale down
and roll out without cutting responses.

A forced shutdown (the drain timeout expires with requests in flight, a second SIGTERM, or
SIGINT) cuts the requests in flight cleanly: each stream ends with an error event and
``data: [DONE]``, other requests get a 503, one line is logged with the count, and the
process exits 1 (requests were lost). A third signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)


class Lifecycle:
    """State shared by the routes, the gate middleware and the signal handler."""

    def __init__(self, drain_timeout: float = 30.0) -> None:
        self.drain_timeout = drain_timeout  # seconds
        self.loaded = False  # engine built and its loop started
        self.warmed_up = False
        self.draining = False
        self.inflight = 0  # API requests being answered (streams included)
        self.fatal_error: str | None = None
        self.request_exit: Callable[[], None] | None = None  # set by the launcher
        self.cut: Callable[[str], int] | None = None  # set by the app: ends requests in flight
        self.num_cut = 0  # requests in flight when a forced shutdown cut them
        self.forcing = False
        self._drain_task: asyncio.Task[None] | None = None
        self._force_task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        return self.loaded and self.warmed_up and not self.draining and self.fatal_error is None

    @property
    def exit_code(self) -> int:
        """0 after a clean drain; 1 after a fatal error or when requests were cut."""
        return 1 if self.fatal_error or self.num_cut else 0

    def fail(self, message: str) -> None:
        """A fatal error (start-up failed, the engine died): not ready, unhealthy, and the
        process exits 1."""
        if self.fatal_error is None:
            self.fatal_error = message
            log.error("exiting: %s", message)
        self._exit()

    def _exit(self) -> None:
        if self.request_exit is not None:
            self.request_exit()

    def begin_drain(self) -> None:
        """Starts draining (idempotent); call on the event loop."""
        self.draining = True
        if self._drain_task is not None:
            return
        log.info(
            "draining: %d request(s) in flight, waiting up to %.0fs",
            self.inflight,
            self.drain_timeout,
        )
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            if self.forcing:  # a second signal took over
                return
        if self.inflight:
            await self.force(f"drain timeout of {self.drain_timeout:g}s")
            return
        log.info("drained: no request in flight")
        self._exit()

    def begin_force(self, reason: str) -> None:
        """Starts a forced shutdown (idempotent); call on the event loop."""
        self.draining = True
        if self._force_task is None:
            self._force_task = asyncio.get_running_loop().create_task(self.force(reason))

    async def force(self, reason: str, flush_s: float = 2.0) -> None:
        """Ends every request in flight with an error, waits up to ``flush_s`` for their
        last events to be written, then exits (code 1 if any was cut)."""
        self.forcing = self.draining = True
        cut = self.cut(reason) if self.cut is not None else self.inflight
        self.num_cut = max(cut, self.inflight)
        if self.num_cut:
            log.warning(
                "forced shutdown (%s): %d request(s) in flight cut, each answered with an "
                "error; exiting with code 1",
                reason,
                self.num_cut,
            )
        deadline = time.monotonic() + flush_s
        while self.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._exit()


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first and the process exits 0 afterwards."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.request_exit = self._request_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _request_exit(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutting
        # down and the process would die of SIGTERM instead of exiting 0.
        lc = self.lifecycle
        first_term = sig == signal.SIGTERM and not lc.draining
        if first_term and not self.should_exit and self._loop is not None:
            lc.draining = True  # /ready and new requests fail from this instant
            self._loop.call_soon_threadsafe(lc.begin_drain)
            return
        if not lc.forcing and not self.should_exit and self._loop is not None:
            lc.forcing = lc.draining = True
            name = signal.Signals(sig).name
            reason = f"second {name}" if sig == signal.SIGTERM else name
            self._loop.call_soon_threadsafe(lc.begin_force, reason)
            return
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
