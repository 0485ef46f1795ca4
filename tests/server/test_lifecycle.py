"""Client disconnects, the queue limit and SIGTERM drain, on a deliberately small server:
40 KV blocks, one sequence at a time, at most one waiting."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import ServerProcess, metric

LONG = 480  # tokens: a few seconds of decoding on a CPU


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        llama_ckpt,
        "--num-kv-blocks", "40", "--block-size", "16", "--max-model-len", "512",
        "--max-num-seqs", "1", "--max-queue-len", "1", "--drain-timeout", "60",
    )  # fmt: skip


def test_the_start_log_names_the_batch_limits(server: ServerProcess) -> None:
    # --max-num-seqs as given; the graphs' limit defaults to at most that
    assert "max_num_seqs 1, cuda_graph_max_batch 1" in server.log(), server.log()


def _stream_body(max_tokens: int = LONG) -> dict[str, Any]:
    return {
        "prompt": [1, 415, 2936, 9060],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _events(resp: httpx.Response) -> Iterator[str]:
    for line in resp.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _idle(server: ServerProcess) -> bool:
    m = server.metrics()
    free = metric(m, "kvscale:kv_cache_blocks_free")
    return (
        free == metric(m, "kvscale:kv_cache_blocks_total")
        and metric(m, "kvscale:num_requests_running") == 0
    )


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    _wait_for(lambda: _idle(server), 30, "an idle server")
    before = server.metrics()
    aborts = metric(before, "kvscale:request_success_total", finished_reason="abort")
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=_stream_body()) as resp:
            assert resp.status_code == 200
            events = _events(resp)
            for _ in range(5):
                next(events)
            m = server.metrics()
            assert metric(m, "kvscale:num_requests_running") == 1
            assert metric(m, "kvscale:kv_cache_blocks_free") < metric(
                m, "kvscale:kv_cache_blocks_total"
            )
            assert metric(m, "kvscale:kv_cache_usage_perc") > 0
        # leaving the block closed the connection mid-stream
    t0 = time.monotonic()
    _wait_for(lambda: _idle(server), 10, "blocks freed after the disconnect")
    assert time.monotonic() - t0 < 5.0  # at once; the token count below proves it
    m = server.metrics()
    assert metric(m, "kvscale:request_success_total", finished_reason="abort") == aborts + 1
    assert (
        metric(m, "kvscale:generation_tokens_total")
        - metric(before, "kvscale:generation_tokens_total")
        < LONG
    )


def test_disconnect_of_a_non_streaming_request_aborts_it(server: ServerProcess) -> None:
    _wait_for(lambda: _idle(server), 30, "an idle server")
    before = server.metrics()
    body = {"prompt": [1, 415], "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    _wait_for(lambda: _idle(server), 10, "the abort of the abandoned request")
    m = server.metrics()
    assert metric(m, "kvscale:request_success_total", finished_reason="abort") == 1 + metric(
        before, "kvscale:request_success_total", finished_reason="abort"
    )


def test_queue_full_answers_429_with_retry_after(server: ServerProcess) -> None:
    _wait_for(lambda: _idle(server), 30, "an idle server")
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        with a.stream("POST", url, json=_stream_body()) as ra:
            assert ra.status_code == 200
            events_a = _events(ra)  # kept: dropping the iterator would close the connection
            next(events_a)  # A is running
            with b.stream("POST", url, json=_stream_body()) as rb:
                assert rb.status_code == 200  # B waits: the queue now holds 1
                r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
                assert r.status_code == 429
                assert r.headers["Retry-After"] == "1"
                err = r.json()["error"]
                assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
                assert "max_queue_len=1" in err["message"]
    _wait_for(lambda: _idle(server), 10, "both streams aborted")
    ok = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_sigterm_drains_the_in_flight_stream_then_exits_0(server: ServerProcess) -> None:
    _wait_for(lambda: _idle(server), 30, "an idle server")
    n = 300
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/completions", json=_stream_body(n)) as resp:
            events = _events(resp)
            next(events)
            server.signal(signal.SIGTERM)
            t0 = time.monotonic()
            _wait_for(
                lambda: httpx.get(f"{server.url}/ready").status_code == 503, 5, "/ready to fail"
            )
            assert time.monotonic() - t0 < 2.0
            assert httpx.get(f"{server.url}/ready").json() == {"status": "draining"}
            assert httpx.get(f"{server.url}/health").status_code == 200
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            rest = list(events)
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in rest[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == n
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert server.wait_exit(30) == 0
    log = server.log()
    assert "draining" in log and "drained" in log
