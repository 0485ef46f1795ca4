"""Run the emulator in a background thread (its own event loop) so that blocking tests,
``kubectl`` and ``kopf run`` subprocesses can talk to it over loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml

from tests.k8s_emulator.server import ApiServer

T = TypeVar("T")


class EmulatorThread:
    """``with EmulatorThread() as emu: emu.url, emu.call(fn)``; stops by itself on exit."""

    def __init__(self) -> None:
        self.api: ApiServer | None = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self._error = e
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with ApiServer() as api, kmock.Server(api, host="127.0.0.1") as server:
            self.api = api
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(timeout=30) or self._error:
            raise RuntimeError(f"the API emulator did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=10)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the emulator's loop (state is only touched from there) and return."""
        assert self._loop is not None
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:
                fut.set_exception(e)

        self._loop.call_soon_threadsafe(run)
        return fut.result(timeout=30)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        """``emu.set_status(...)``, ``emu.get(...)``...: the ApiServer's helpers, thread-safe."""
        attr = getattr(self.api, name)
        if not callable(attr):
            return self.call(lambda: getattr(self.api, name))
        return lambda *a, **kw: self.call(attr, *a, **kw)

    def write_kubeconfig(
        self, path: Path, namespace: str = "default", token_file: Path | None = None
    ) -> Path:
        """A kubeconfig for the emulator; ``token_file``: read the token from that file
        (``tokenFile``), so that tests can rotate it."""
        user = {"tokenFile": str(token_file)} if token_file else {"token": "emulator"}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": user}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "tester", "namespace": namespace},
                }
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path
