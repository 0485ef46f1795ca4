"""Runs the real server (``python -m kvscale.cli serve``) as a subprocess on a free
loopback port, waits for ``/ready`` (bounded) and always kills it afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.ports import free_port

START_TIMEOUT_S = 90.0  # import torch + load a tiny checkpoint + warm up, on 2 slow cores


def server_env() -> dict[str, str]:
    """No hub; and the repo's operator/ folder must not shadow the stdlib module."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONSAFEPATH="1")


class KvscaleProcess:
    """One ``python -m kvscale.cli COMMAND ...`` process on a free loopback port; its
    combined output goes to ``log_path``."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "kvscale.cli", *argv, "--host", "127.0.0.1",
               "--port", str(self.port)]  # fmt: skip
        self._log = open(log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=server_env()
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_http(self, path: str, timeout: float) -> None:
        """Until ``GET path`` answers 200; RuntimeError if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.proc.args[3]} exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.url}{path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{path} not 200 after {timeout}s:\n{self.log()}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def metrics(self) -> dict[str, float]:
        """Every sample of ``/metrics`` as ``name{labels}`` -> value (labels sorted)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out


class ServerProcess(KvscaleProcess):
    """One ``kvscale serve`` process on the CPU."""

    def __init__(self, model: Path, args: list[str], log_path: Path) -> None:
        argv = ["serve", "--model", str(model), *args, "--device", "cpu",
                "--served-model-name", "tiny"]  # fmt: skip
        super().__init__(argv, log_path)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        self.wait_http("/ready", timeout)


@pytest.fixture(scope="module")
def start_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(model, *args)`` -> a ready ServerProcess, killed after the module."""
    procs: list[ServerProcess] = []

    def start(model: Path, *args: str, wait: bool = True) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        proc = ServerProcess(model, list(args), log)
        procs.append(proc)
        if wait:
            proc.wait_ready()
        return proc

    yield start
    for p in procs:
        p.stop()


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of one sample (labels besides model_name=tiny given as keywords)."""
    want = {"model_name": "tiny", **labels}
    key = ",".join(f"{k}={v}" for k, v in sorted(want.items()))
    return samples.get(f"{name}{{{key}}}", 0.0)
