"""Router processes (``python -m kvscale.cli route``) and in-process stub replicas."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port
from tests.server.conftest import KvscaleProcess
from tests.server.conftest import start_server as start_server  # the fixture, for these tests

ROUTER_START_TIMEOUT_S = 90.0


class RouterProcess(KvscaleProcess):
    """One ``kvscale route`` process on a free loopback port."""

    def __init__(self, upstreams: list[str], args: list[str], log_path: Path) -> None:
        super().__init__(["route", "--upstream", *upstreams, *args], log_path)

    def wait_up(self, timeout: float = ROUTER_START_TIMEOUT_S) -> None:
        self.wait_http("/health", timeout)

    def wait_replicas_ready(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(f"{self.url}/ready", timeout=5).json()["replicas_ready"] == n:
                return
            time.sleep(0.05)
        raise TimeoutError(f"the router does not see {n} ready replicas")


def rmetric(samples: dict[str, float], name: str, **labels: str) -> float:
    key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return samples.get(f"{name}{{{key}}}", 0.0)


@pytest.fixture(scope="module")
def start_router(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RouterProcess]]:
    """``start_router(upstreams, *args, wait=True)`` -> a RouterProcess, killed after the
    module."""
    procs: list[RouterProcess] = []

    def start(upstreams: list[str], *args: str, wait: bool = True) -> RouterProcess:
        log = tmp_path_factory.mktemp("router") / "router.log"
        proc = RouterProcess(upstreams, list(args), log)
        procs.append(proc)
        if wait:
            proc.wait_up()
        return proc

    yield start
    for p in procs:
        p.stop()


class Stub:
    """A fake replica on a fixed loopback port, served by uvicorn in a thread: ``/ready``
    answers 200 or 503 as ``ready`` says, ``/metrics`` ``metrics_text``, and every other
    request
    ``{"stub": port}`` (counted in ``hits``). ``stop()`` closes the port; ``start()``
    opens it again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready = True
        self.draining = False  # answer 503 to requests (while /ready may still say 200)
        self.hits = 0
        self.metrics_text = ""  # what /metrics answers
        self._server = None
        self._thread: threading.Thread | None = None

    async def _app(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        from starlette.responses import JSONResponse, PlainTextResponse

        if scope["type"] != "http":
            return
        if scope["path"] == "/ready":
            resp = JSONResponse({}, 200 if self.ready else 503)
        elif scope["path"] == "/metrics":
            resp = PlainTextResponse(self.metrics_text)
        elif self.draining:
            resp = JSONResponse({"error": {"code": "draining"}}, 503)
        else:
            self.hits += 1
            resp = JSONResponse({"stub": self.port})
        await resp(scope, receive, send)

    def start(self) -> None:
        import uvicorn

        cfg = uvicorn.Config(
            self._app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            interface="asgi3",
        )
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "stub did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(10)
            self._server = None
