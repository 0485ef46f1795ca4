"""The router's rotation and holding, against stub replicas (no model): a replica whose
/ready is not 200 gets nothing new and rejoins when ready; with no replica up a request
is held up to --hold-timeout, then 503 + Retry-After; one that comes back in time answers
the held request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from .conftest import RouterProcess, Stub, rmetric

HOLD_TIMEOUT_S = 3.0
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def stubs() -> Iterator[list[Stub]]:
    s = [Stub(), Stub()]
    for x in s:
        x.start()
    yield s
    for x in s:
        x.stop()


@pytest.fixture(scope="module")
def router(stubs: list[Stub], start_router: Callable[..., RouterProcess]) -> RouterProcess:
    r = start_router(
        [s.url for s in stubs],
        "--policy", "random", "--seed", "0", "--scrape-interval", "0.1",
        "--hold-timeout", str(HOLD_TIMEOUT_S), "--hold-queue-size", "4", "--api-key", KEY,
        "--max-request-body-bytes", "1000",
    )  # fmt: skip
    r.wait_replicas_ready(2)
    return r


def _complete(router: RouterProcess, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "tiny", "prompt": "hi"},
        headers=AUTH,
        timeout=timeout,
    )


def test_a_replica_not_ready_gets_nothing_new_and_rejoins(
    router: RouterProcess, stubs: list[Stub]
) -> None:
    a, b = stubs
    try:
        a.ready = False
        router.wait_replicas_ready(1)
        a0, b0 = a.hits, b.hits
        for _ in range(8):
            r = _complete(router)
            assert r.status_code == 200 and r.json() == {"stub": b.port}
        assert (a.hits, b.hits) == (a0, b0 + 8)
        assert rmetric(router.metrics(), "kvscale_router:replica_ready", replica=a.url) == 0
    finally:
        a.ready = True
    router.wait_replicas_ready(2)
    a0 = a.hits
    for _ in range(12):
        assert _complete(router).status_code == 200
    assert a.hits > a0  # back in the rotation (random policy, seeded)


def test_a_503_is_retried_on_another_replica(router: RouterProcess, stubs: list[Stub]) -> None:
    a, b = stubs
    a.draining = True  # its /ready still says 200: the router learns it from the 503
    try:
        b0 = b.hits
        for _ in range(6):
            r = _complete(router)
            assert r.status_code == 200 and r.json() == {"stub": b.port}
        assert b.hits == b0 + 6
        m = router.metrics()
        assert rmetric(m, "kvscale_router:upstream_errors_total", kind="unavailable", replica=a.url)
    finally:
        a.draining = False
    router.wait_replicas_ready(2)  # back at the next poll


def test_no_replica_holds_then_503_with_retry_after(
    router: RouterProcess, stubs: list[Stub]
) -> None:
    for s in stubs:
        s.stop()  # connections refused
    try:
        router.wait_replicas_ready(0)
        t0 = time.monotonic()
        r = _complete(router)
        waited = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_replica_ready"
        assert HOLD_TIMEOUT_S - 0.2 <= waited < HOLD_TIMEOUT_S + 5
        m = router.metrics()
        assert rmetric(m, "kvscale_router:requests_total", outcome="no_replica", replica="") >= 1
        assert rmetric(m, "kvscale_router:hold_time_seconds_count") >= 1

        # a replica coming back within the timeout answers the held request
        got: list[httpx.Response] = []
        t = threading.Thread(target=lambda: got.append(_complete(router)))
        t.start()
        deadline = time.monotonic() + 10
        while httpx.get(f"{router.url}/ready", timeout=5).json()["held"] != 1:
            assert time.monotonic() < deadline, "the request was not held"
            time.sleep(0.02)
        assert rmetric(router.metrics(), "kvscale_router:held_requests") == 1
        stubs[1].start()
        t.join(HOLD_TIMEOUT_S + 10)
        assert got and got[0].status_code == 200 and got[0].json() == {"stub": stubs[1].port}
        assert rmetric(router.metrics(), "kvscale_router:held_requests") == 0
    finally:
        for s in stubs:
            if s._server is None:
                s.start()
    router.wait_replicas_ready(2)


def test_api_key_is_checked_at_the_router(router: RouterProcess, stubs: list[Stub]) -> None:
    hits = sum(s.hits for s in stubs)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        bad = httpx.post(f"{router.url}/v1/completions", json={}, headers=headers, timeout=10)
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert bad.headers["www-authenticate"] == "Bearer"
    assert sum(s.hits for s in stubs) == hits  # never reached a replica
    assert _complete(router).status_code == 200  # the key is passed on (stubs ignore it)
    assert sum(s.hits for s in stubs) == hits + 1
    for path in ("/health", "/ready", "/metrics"):  # no key needed
        assert httpx.get(f"{router.url}{path}", timeout=5).status_code == 200


def test_a_body_over_the_limit_gets_413(router: RouterProcess, stubs: list[Stub]) -> None:
    hits = sum(s.hits for s in stubs)
    url = f"{router.url}/v1/completions"
    big = {"model": "tiny", "prompt": "x" * 2000}
    r = httpx.post(url, json=big, headers=AUTH, timeout=10)  # Content-Length says so
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked, counted while read
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    r = httpx.post(url, content=chunks(), headers=AUTH, timeout=10)
    assert r.status_code == 413
    assert sum(s.hits for s in stubs) == hits
    assert _complete(router).status_code == 200  # small bodies pass


def test_the_router_shows_the_load_it_scraped(router: RouterProcess, stubs: list[Stub]) -> None:
    """The replicas' reported load (running + waiting, KV usage) appears in the router's
    own /metrics after the next scrape, and follows the replicas' changes."""
    a, b = stubs
    key = "kvscale_router:replica_reported_requests"
    a.metrics_text = (
        'kvscale:num_requests_running{model_name="m"} 3.0\n'
        'kvscale:num_requests_waiting{model_name="m"} 2.0\n'
        'kvscale:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    try:
        deadline = time.monotonic() + 10
        while rmetric(router.metrics(), key, replica=a.url) != 5:
            assert time.monotonic() < deadline, router.metrics()
            time.sleep(0.05)
        m = router.metrics()
        assert rmetric(m, "kvscale_router:replica_kv_cache_usage", replica=a.url) == 0.5
        assert f"{key}{{replica={b.url}}}" in m and rmetric(m, key, replica=b.url) == 0
    finally:
        a.metrics_text = ""
    while rmetric(router.metrics(), key, replica=a.url) != 0:
        assert time.monotonic() < deadline, router.metrics()
        time.sleep(0.05)
