"""``kvscale serve --tensor-parallel-size 2`` on the CPU (gloo): it serves, and a rank
killed mid-stream fails the stream with the reason, never answers ready again, and the
server exits non-zero naming the rank and the signal."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from .conftest import ServerProcess

EXIT_TIMEOUT_S = 30.0


def test_killing_a_rank_fails_the_stream_and_the_server_exits_nonzero(
    start_server: Callable[..., ServerProcess], llama_ckpt: Path
) -> None:
    server = start_server(llama_ckpt, "--tensor-parallel-size", "2", "--num-kv-blocks", "64")
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    found = re.search(r"tensor-parallel rank 1 started: pid (\d+)", server.log())
    assert found, server.log()
    pid = int(found.group(1))

    stream = {**body, "max_tokens": 900, "ignore_eos": True, "stream": True}
    events: list[dict] = []
    killed = False
    with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 3 and not killed:
                os.kill(pid, signal.SIGKILL)
                killed = True
    assert killed and len(events) < 900
    error = events[-1].get("error", {}).get("message", "")
    assert f"rank 1 (pid {pid}) was killed by signal SIGKILL" in error, events[-1]

    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:  # until it exits, the failed server is never ready again
            assert httpx.get(f"{server.url}/ready", timeout=2).status_code == 503
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    code = server.wait_exit(timeout=5)
    assert code != 0
    log = server.log()
    assert (
        f"the engine failed: tensor-parallel rank 1 (pid {pid}) was killed by signal SIGKILL"
        in (log)
    ), log[-3000:]
