"""Three real servers (prefix caching on) behind real routers on loopback.

The bench client's shared-prefix and multi-turn workloads run through a ``--policy
prefix`` router and then (caches reset) a ``--policy random`` one; the servers' summed
prefix-cache hit rate must be clearly higher with prefix routing. Then: streaming passes
through intact, a client disconnect aborts the request upstream, and (last: it kills a
server) a SIGKILLed replica costs no request that had not started streaming.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvscale.bench_serve import run_benchmark
from kvscale.router.balance import HashRing, prefix_key
from tests.server.conftest import ServerProcess, metric

from .conftest import RouterProcess, rmetric

SERVER_ARGS = ("--num-kv-blocks", "2048", "--max-model-len", "1024")
BLOCK = 16


@pytest.fixture(scope="module")
def cluster(
    llama_ckpt: Path,
    start_server: Callable[..., ServerProcess],
    start_router: Callable[..., RouterProcess],
) -> dict[str, Any]:
    """3 servers; routers: prefix, random (seeded), and a prefix router without tokenizer
    that polls ready replicas only every 600 s (so that it finds a killed replica by a
    refused connection)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # six processes start at once on few cores
        servers = [start_server(llama_ckpt, *SERVER_ARGS, wait=False) for _ in range(3)]
        urls = [s.url for s in servers]
        poll = ["--hold-timeout", "20", "--scrape-interval"]
        routers = {
            # only this one loads the tokenizer: the others see token ids or ignore prompts
            "prefix": start_router(urls, "--tokenizer", str(llama_ckpt), *poll, "0.25", wait=False),
            "random": start_router(
                urls, "--policy", "random", "--seed", "0", *poll, "0.25", wait=False
            ),
            "slow": start_router(urls, *poll, "600", wait=False),
        }  # fmt: skip
    for p in [*servers, *routers.values()]:
        p.wait_ready() if isinstance(p, ServerProcess) else p.wait_up()
    for r in routers.values():
        r.wait_replicas_ready(3)
    return {"servers": servers, **routers}


def homed_at(ring: HashRing, url: str, salt: int) -> list[int]:
    """A 4-block token-id prompt whose routing key's home replica is ``url``."""
    for i in range(10_000):
        ids = [100 + (salt * 7919 + i * 31 + j) % 4000 for j in range(4 * BLOCK)]
        if next(ring.walk(prefix_key(ids, BLOCK, 4))) == url:  # type: ignore[arg-type]
            return ids
    raise AssertionError("no prompt found")


def _idle(servers: list[ServerProcess]) -> list[dict[str, float]]:
    """Every server's /metrics once none runs or queues a sequence (bounded wait)."""
    for _ in range(200):
        ms = [s.metrics() for s in servers]
        if all(
            metric(m, "kvscale:num_requests_running") == 0
            and metric(m, "kvscale:num_requests_waiting") == 0
            for m in ms
        ):
            return ms
        time.sleep(0.05)
    raise AssertionError("requests still running")


def _bench(url: str, dataset: str, extra: list[str]) -> dict[str, Any]:
    from kvscale.cli import build_parser

    argv = [
        "bench", "serve", "--base-url", url, "--dataset", dataset, "--output-len", "4",
        "--max-concurrency", "3", "--seed", "5", "--result-file", "", "--disable-tqdm",
        *extra,
    ]  # fmt: skip
    args: argparse.Namespace = build_parser().parse_args(argv)
    res = asyncio.run(run_benchmark(args))
    assert res["failed_requests"] == 0, res["errors"]
    return res


WORKLOADS = [
    # 8 system prompts of 64 tokens (4 blocks) + a 16-token question, 3 requests each
    ("prefix", ["--num-prompts", "24", "--prefix-groups", "8", "--prefix-len", "64",
                "--input-len", "16"]),
    # 4 conversations of 3 turns, 64-token messages
    ("multi-turn", ["--prefix-groups", "4", "--turns", "3", "--input-len", "64"]),
]  # fmt: skip


def _run_policy(cluster: dict[str, Any], policy: str) -> dict[str, float]:
    servers: list[ServerProcess] = cluster["servers"]
    for s in servers:
        assert httpx.post(f"{s.url}/reset_prefix_cache", timeout=10).status_code == 200
    before = _idle(servers)
    ttfts = []
    for dataset, extra in WORKLOADS:
        res = _bench(cluster[policy].url, dataset, extra)
        ttfts.append(res["median_ttft_ms"])
    after = _idle(servers)

    def total(name: str) -> float:
        return sum(metric(a, name) - metric(b, name) for a, b in zip(after, before, strict=True))

    q, h = total("kvscale:prefix_cache_queries_total"), total("kvscale:prefix_cache_hits_total")
    per_server = [
        metric(a, "kvscale:request_success_total", finished_reason="length")
        - metric(b, "kvscale:request_success_total", finished_reason="length")
        for a, b in zip(after, before, strict=True)
    ]
    return {
        "hit_rate": h / q,
        "queries": q,
        "ttft_prefix_ms": ttfts[0],
        "ttft_multi_turn_ms": ttfts[1],
        "per_server": per_server,  # type: ignore[dict-item]
    }


def test_prefix_routing_hits_the_cache_more_than_random(cluster: dict[str, Any]) -> None:
    pre = _run_policy(cluster, "prefix")
    rnd = _run_policy(cluster, "random")
    print(
        f"\nrouter prefix: hit rate {pre['hit_rate']:.3f}, median TTFT {pre['ttft_prefix_ms']:.1f}"
        f" ms (shared prefix) / {pre['ttft_multi_turn_ms']:.1f} ms (multi-turn), requests per "
        f"server {pre['per_server']}\n"
        f"router random: hit rate {rnd['hit_rate']:.3f}, median TTFT {rnd['ttft_prefix_ms']:.1f}"
        f" ms (shared prefix) / {rnd['ttft_multi_turn_ms']:.1f} ms (multi-turn), requests per "
        f"server {rnd['per_server']}"
    )
    m = cluster["prefix"].metrics()
    print({k: v for k, v in m.items() if "decisions_total" in k})
    assert pre["queries"] == rnd["queries"] > 0  # the same prompt tokens both times
    # Observed on 2 cores: prefix 0.475-0.548 against random 0.265-0.283 over five runs,
    # 0.420 against 0.301 in a clean-clone CI run (3 requests in flight: when they share a
    # home replica, the load bound sends some elsewhere; the busier the machine, the more
    # overlap). Random routing's own hit rate is what prefix routing must clearly beat.
    assert pre["hit_rate"] > rnd["hit_rate"] + 0.08
    assert all(n > 0 for n in pre["per_server"])  # affinity, but every replica used
    # no replica above its load bound: every choice had (load + 1) / bound <= 1
    n = rmetric(m, "kvscale_router:decision_load_ratio_count")
    assert n >= 36 and rmetric(m, "kvscale_router:decision_load_ratio_bucket", le="1.0") == n
    assert rmetric(m, "kvscale_router:routing_decisions_total", reason="prefix_hit") > 0


def _sse_text(resp_lines: list[str]) -> str:
    text = ""
    for line in resp_lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            obj = json.loads(line[6:])
            for c in obj["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def test_streaming_passes_through_intact(cluster: dict[str, Any]) -> None:
    url = cluster["prefix"].url
    for path, body in (
        ("/v1/completions", {"prompt": "The router sends this prompt on to one replica"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]}),
    ):
        body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "ignore_eos": True, **body}
        full = httpx.post(url + path, json=body, timeout=60)
        assert full.status_code == 200, full.text
        choice = full.json()["choices"][0]
        want = choice.get("text") if "text" in choice else choice["message"]["content"]
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = list(r.iter_lines())
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        assert sum(x.startswith("data: {") for x in lines) >= 12  # event by event, not one blob
        assert _sse_text(lines) == want and want


def test_the_router_sees_the_prompt_tokens_the_server_runs(
    cluster: dict[str, Any], llama_ckpt: Path
) -> None:
    """The routing key's token ids: the server's own tokenization (BOS) and chat rendering."""
    from kvscale.router.prompt import PromptTokenizer, prompt_token_ids

    tok = PromptTokenizer(llama_ckpt)
    server = cluster["servers"][1].url
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers, " * 6},
    ]
    for path, body, tokenize_body in (
        ("/v1/chat/completions", {"messages": msgs}, {"messages": msgs}),
        ("/v1/completions", {"prompt": "Once upon a time"}, {"prompt": "Once upon a time"}),
        ("/v1/completions", {"prompt": ["batch first", "second"]}, {"prompt": "batch first"}),
    ):
        want = httpx.post(server + "/tokenize", json=tokenize_body, timeout=30).json()["tokens"]
        assert tok.token_ids(path, body) == want
    assert tok.token_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.token_ids("/v1/chat/completions", {"messages": "not a list"}) is None
    # without a tokenizer: token-id prompts only
    assert prompt_token_ids("/v1/completions", {"prompt": [[5, 6], [7]]}, None) == [5, 6]
    assert prompt_token_ids("/v1/completions", {"prompt": "text"}, None) is None


def test_client_disconnect_aborts_upstream(cluster: dict[str, Any]) -> None:
    servers: list[ServerProcess] = cluster["servers"]
    before = _idle(servers)
    router_before = _client_disconnects(cluster["prefix"])
    body = {
        "model": "tiny", "prompt": "a long answer, please", "max_tokens": 900,
        "ignore_eos": True, "temperature": 0, "stream": True,
    }  # fmt: skip
    with httpx.stream(
        "POST", cluster["prefix"].url + "/v1/completions", json=body, timeout=60
    ) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break  # leaving the block closes the connection mid-stream
    after = _idle(servers)  # nothing runs any more: it was aborted, not run to the end

    def delta(reason: str) -> float:
        return sum(
            metric(a, "kvscale:request_success_total", finished_reason=reason)
            - metric(b, "kvscale:request_success_total", finished_reason=reason)
            for a, b in zip(after, before, strict=True)
        )

    assert delta("abort") == 1 and delta("length") == 0
    # (a delta: a client that closes after [DONE] but before the end of the chunked body,
    # as the bench client may, also counts as a disconnect)
    assert _client_disconnects(cluster["prefix"]) - router_before == 1


def _client_disconnects(router: RouterProcess) -> float:
    m = router.metrics()
    return sum(
        v for k, v in m.items() if k.startswith("kvscale_router:requests_total{outcome=client_disc")
    )


def test_killed_replica_costs_no_request_that_had_not_started(cluster: dict[str, Any]) -> None:
    """Runs last: it kills a server."""
    servers: list[ServerProcess] = cluster["servers"]
    router: RouterProcess = cluster["slow"]
    urls = [s.url for s in servers]
    ring = HashRing(urls)
    victim = servers[0]

    results: dict[int, dict[str, Any]] = {}

    def stream(i: int, ids: list[int]) -> None:
        res = results[i] = {"started": False, "done": False, "error": None}
        body = {
            "model": "tiny", "prompt": ids, "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True,
        }  # fmt: skip
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    res["started"] = True
                    if line == "data: [DONE]":
                        res["done"] = True
        except Exception as e:
            res["error"] = repr(e)

    # two long streams homed at each replica, started one after another in the order
    # s0 s1 s2 s0 s1 s2, so that each fits its home's load bound (all at once, a home
    # could be over the bound for a moment and one stream spill to the next replica)
    threads = []
    deadline = time.monotonic() + 60
    for i, s in enumerate(servers * 2):
        t = threading.Thread(target=stream, args=(i, homed_at(ring, s.url, i)))
        t.start()
        threads.append(t)
        while not results.get(i, {}).get("started"):
            assert time.monotonic() < deadline, results
            time.sleep(0.02)
    victim.signal(signal.SIGKILL)
    victim.wait_exit(10)
    # new requests homed at the dead replica: refused there, retried elsewhere
    for k in range(3):
        body = {"model": "tiny", "prompt": homed_at(ring, victim.url, 100 + k), "max_tokens": 4}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    for t in threads:
        t.join(120)
    failed = [r for r in results.values() if not r["done"]]
    assert len(failed) == 2  # the two streaming at the victim when it died
    assert all(r["started"] and r["error"] for r in failed)  # after bytes: not retried
    m = router.metrics()
    assert rmetric(m, "kvscale_router:upstream_errors_total", kind="connect", replica=victim.url)
    assert rmetric(m, "kvscale_router:retries_total") >= 1
    # they went to the victim as its prefixes (its streams' failures made it the least
    # loaded too: the key, not that, must have chosen it)
    assert rmetric(m, "kvscale_router:routing_decisions_total", reason="prefix_hit") >= 9
    assert (
        rmetric(m, "kvscale_router:upstream_errors_total", kind="midstream", replica=victim.url)
        == 2
    )
    assert rmetric(m, "kvscale_router:replica_ready", replica=victim.url) == 0


def test_a_draining_replica_gets_nothing_new(cluster: dict[str, Any]) -> None:
    """Runs after the kill: SIGTERM makes a server drain (its /ready answers 503, requests
    in flight finish); the router takes it out of the rotation, its prefixes go elsewhere,
    and its stream ends normally."""
    servers: list[ServerProcess] = cluster["servers"]
    router: RouterProcess = cluster["prefix"]
    drained, other = servers[1], servers[2]
    ring = HashRing([s.url for s in servers])

    done: dict[str, Any] = {"lines": [], "error": None}

    def stream() -> None:
        body = {
            "model": "tiny", "prompt": homed_at(ring, drained.url, 1001), "max_tokens": 300,
            "ignore_eos": True, "temperature": 0, "stream": True,
        }  # fmt: skip
        try:
            with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    done["lines"].append(line)
        except Exception as e:
            done["error"] = repr(e)

    # The last test's streams ran through another router: this one counts them as load at
    # their replicas until its next scrape, and a stale load could send the stream past
    # its home. Wait until it has seen them end.
    _idle([drained, other])
    deadline = time.monotonic() + 30
    seen = "kvscale_router:replica_reported_requests{{replica={}}}"
    while any(router.metrics()[seen.format(s.url)] for s in (drained, other)):
        assert time.monotonic() < deadline, "the router still sees the last test's load"
        time.sleep(0.05)
    key = {"replica": drained.url, "outcome": "2xx"}
    before = rmetric(router.metrics(), "kvscale_router:requests_total", **key)
    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while not done["lines"]:
        assert time.monotonic() < deadline and t.is_alive(), done
        time.sleep(0.02)
    drained.signal(signal.SIGTERM)
    while rmetric(router.metrics(), "kvscale_router:replica_ready", replica=drained.url) != 0:
        assert time.monotonic() < deadline, "the router kept the draining replica"
        time.sleep(0.05)
    other_before = metric(
        other.metrics(), "kvscale:request_success_total", finished_reason="length"
    )
    for k in range(3):  # its prefixes now go to another replica
        body = {
            "model": "tiny",
            "prompt": homed_at(ring, drained.url, 1050 + k),
            "max_tokens": 4,
        }
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    t.join(120)
    assert done["error"] is None, done
    assert "data: [DONE]" in done["lines"][-2:], done["lines"][-3:]  # finished, not cut
    assert drained.wait_exit(60) == 0
    m = router.metrics()
    assert rmetric(m, "kvscale_router:requests_total", **key) - before == 1  # the stream only
    after = metric(other.metrics(), "kvscale:request_success_total", finished_reason="length")
    assert after - other_before == 3
