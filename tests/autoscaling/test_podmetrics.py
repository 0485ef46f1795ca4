"""Reading per-pod metrics: both formats through one path, pod targets, fetch errors."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from kvscale.operator import podmetrics as pm
from kvscale.operator.scaling import PodSample

# What `kvscale serve` answers on /metrics (abridged), for one pod.
EXPOSITION = """\
# HELP kvscale:num_requests_running Sequences in the running batch.
# TYPE kvscale:num_requests_running gauge
kvscale:num_requests_running{model_name="demo"} 4.0
# HELP kvscale:num_requests_waiting Sequences waiting to be scheduled (incl. preempted).
# TYPE kvscale:num_requests_waiting gauge
kvscale:num_requests_waiting{model_name="demo"} 3.0
# HELP kvscale:kv_cache_usage_perc Fraction of KV-cache blocks in use, 0..1.
# TYPE kvscale:kv_cache_usage_perc gauge
kvscale:kv_cache_usage_perc{model_name="demo"} 0.8125
# HELP kvscale:request_success_total Finished sequences by finish reason.
# TYPE kvscale:request_success_total counter
kvscale:request_success_total{finished_reason="stop",model_name="demo"} 12.0
# HELP kvscale:e2e_request_latency_seconds Arrival to last token of a request.
# TYPE kvscale:e2e_request_latency_seconds histogram
kvscale:e2e_request_latency_seconds_bucket{le="0.3",model_name="demo"} 1.0
kvscale:e2e_request_latency_seconds_bucket{le="+Inf",model_name="demo"} 12.0
kvscale:e2e_request_latency_seconds_count{model_name="demo"} 12.0
kvscale:e2e_request_latency_seconds_sum{model_name="demo"} 9.5
"""


def _series(pod: str, name: str, points: list[tuple[float, str]]) -> dict[str, Any]:
    labels = {"__name__": name, "namespace": "ml", "pod": pod, "model_name": "demo"}
    return {"metric": labels, "values": [[t, v] for t, v in points]}


def _matrix(*series: dict[str, Any]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "matrix", "result": list(series)}}


def test_exposition_rows() -> None:
    rows = pm.rows_from_exposition("demo-0", EXPOSITION, 100.0)
    assert sorted(rows, key=lambda r: r.metric) == [
        pm.Row("demo-0", pm.KV_METRIC, 0.8125, 100.0),
        pm.Row("demo-0", pm.QUEUE_METRIC, 3.0, 100.0),
    ]


def test_prometheus_matrix_takes_the_newest_sample() -> None:
    payload = _matrix(
        _series("demo-0", pm.KV_METRIC, [(97.0, "0.5"), (98.0, "0.8125")]),
        _series("demo-0", pm.QUEUE_METRIC, [(98.0, "3")]),
        _series("other", "kvscale:num_requests_running", [(98.0, "4")]),  # not ours
        {"metric": {"__name__": pm.KV_METRIC}, "values": [[98.0, "1"]]},  # no pod label
    )
    assert pm.rows_from_prometheus(payload) == [
        pm.Row("demo-0", pm.KV_METRIC, 0.8125, 98.0),
        pm.Row("demo-0", pm.QUEUE_METRIC, 3.0, 98.0),
    ]
    vector = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": {"__name__": pm.KV_METRIC, "pod": "a"}, "value": [5, "0.25"]}],
        },
    }
    assert pm.rows_from_prometheus(vector) == [pm.Row("a", pm.KV_METRIC, 0.25, 5.0)]


def test_both_sources_give_the_same_samples() -> None:
    """A pod read through Prometheus and read directly: one path, one result."""
    direct = pm.rows_from_exposition("demo-0", EXPOSITION, 98.0)
    via_prometheus = pm.rows_from_prometheus(
        _matrix(
            _series("demo-0", pm.KV_METRIC, [(98.0, "0.8125")]),
            _series("demo-0", pm.QUEUE_METRIC, [(98.0, "3.0")]),
        )
    )
    want = [PodSample("demo-0", 0.8125, 3.0, 98.0), PodSample("demo-1", None, None, None)]
    assert pm.samples_from_rows(direct, ["demo-0", "demo-1"]) == want
    assert pm.samples_from_rows(via_prometheus, ["demo-0", "demo-1"]) == want


def test_samples_aggregate_and_sanitize() -> None:
    rows = [
        pm.Row("a", pm.KV_METRIC, 0.5, 10.0),
        pm.Row("a", pm.KV_METRIC, 1.7, 12.0),  # two series (model names): the highest, <= 1
        pm.Row("a", pm.QUEUE_METRIC, 2.0, 11.0),
        pm.Row("a", pm.QUEUE_METRIC, 3.0, 12.0),  # queues add up
        pm.Row("b", pm.KV_METRIC, math.nan, 12.0),  # NaN is no data
        pm.Row("gone", pm.KV_METRIC, 0.9, 12.0),  # not a ready pod any more
    ]
    assert pm.samples_from_rows(rows, ["a", "b"]) == [
        PodSample("a", 1.0, 5.0, 10.0),  # the oldest series decides the age
        PodSample("b", None, None, None),
    ]


def test_prometheus_errors_are_metrics_errors() -> None:
    with pytest.raises(pm.MetricsError) as e:
        pm.rows_from_prometheus({"status": "error", "errorType": "bad_data", "error": "parse"})
    assert e.value.reason == "PrometheusQueryFailed" and "bad_data: parse" in e.value.message
    with pytest.raises(pm.MetricsError):
        pm.rows_from_prometheus({"status": "success", "data": {"resultType": "scalar"}})


def test_promql_selects_the_pods_and_the_window() -> None:
    query = pm.promql("ml", ["demo-7d9f-abcde", "x.y"], 45.2)
    assert query == (
        '{__name__=~"kvscale:kv_cache_usage_perc|kvscale:num_requests_waiting",'
        'namespace="ml",pod=~"demo-7d9f-abcde|x\\\\.y"}[46s]'
    )


def _pod(
    name: str = "demo-0",
    ip: str | None = "10.0.0.7",
    ready: str = "True",
    annotations: dict[str, str] | None = None,
    ports: list[dict[str, Any]] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "annotations": annotations or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": ready}]}
    if ip:
        status["podIP"] = ip
    return {
        "metadata": meta,
        "spec": {"containers": [{"name": "server", "ports": ports or []}]},
        "status": status,
    }


def test_ready_pods() -> None:
    assert pm.is_ready(_pod())
    assert not pm.is_ready(_pod(ready="False"))
    assert not pm.is_ready(_pod(ip=None))
    assert not pm.is_ready(_pod(deleting=True))


def test_scrape_targets_follow_the_prometheus_annotations() -> None:
    notes = {"prometheus.io/port": "9100", "prometheus.io/path": "/m"}
    assert pm.scrape_target(_pod(annotations=notes)).url == "http://10.0.0.7:9100/m"
    named = [{"name": "http", "containerPort": 8080}]
    assert pm.scrape_target(_pod(ports=named)).url == "http://10.0.0.7:8080/metrics"
    assert pm.scrape_target(_pod()).url == "http://10.0.0.7:8000/metrics"
    assert pm.scrape_target(_pod(ip="fd00::7")).url == "http://[fd00::7]:8000/metrics"


# --- fetching against a local HTTP server ------------------------------------------------------

Handler = Callable[[aiohttp.web.Request], Any]


@contextlib.asynccontextmanager
async def serve(routes: dict[str, Handler]) -> AsyncIterator[str]:
    """A local HTTP server on 127.0.0.1 for these GET routes; yields its base URL."""
    app = aiohttp.web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_query_prometheus() -> None:
    seen: dict[str, str] = {}

    async def query(request: aiohttp.web.Request) -> aiohttp.web.Response:
        seen.update(request.query)
        return aiohttp.web.json_response(_matrix(_series("demo-0", pm.KV_METRIC, [(99.0, "0.5")])))

    async def run() -> None:
        async with serve({"/api/v1/query": query}) as url, aiohttp.ClientSession() as http:
            rows = await pm.query_prometheus(http, url, "ml", ["demo-0"], 6, 2, at=100.0)
            assert rows == [pm.Row("demo-0", pm.KV_METRIC, 0.5, 99.0)]
            assert seen["time"] == "100.000" and seen["query"].endswith("[6s]")
            assert await pm.query_prometheus(http, url, "ml", [], 6, 2) == []  # no ready pods

    asyncio.run(run())


def test_prometheus_failures_name_the_fix() -> None:
    async def broken(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(status=502, text="bad gateway")

    async def run() -> None:
        async with serve({"/api/v1/query": broken}) as url, aiohttp.ClientSession() as http:
            with pytest.raises(pm.MetricsError) as e:
                await pm.query_prometheus(http, url, "ml", ["a"], 6, 2)
            assert e.value.reason == "PrometheusQueryFailed" and "HTTP 502" in e.value.message
            with pytest.raises(pm.MetricsError) as e:
                await pm.query_prometheus(http, "http://127.0.0.1:9", "ml", ["a"], 6, 2)
            assert e.value.reason == "PrometheusUnreachable"
            assert "check spec.autoscaling.prometheusUrl" in e.value.message

    asyncio.run(run())


def test_scrape_pods() -> None:
    async def metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(text=EXPOSITION)

    async def fails(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(status=503)

    async def run() -> None:
        async with (
            serve({"/metrics": metrics}) as good,
            serve({"/metrics": fails}) as bad,
            aiohttp.ClientSession() as http,
        ):
            targets = [pm.PodTarget("a", f"{good}/metrics"), pm.PodTarget("b", f"{bad}/metrics")]
            rows = await pm.scrape_pods(http, targets, 2, 50.0)
            assert pm.samples_from_rows(rows, ["a", "b"]) == [
                PodSample("a", 0.8125, 3.0, 50.0),
                PodSample("b", None, None, None),
            ]
            with pytest.raises(pm.MetricsError) as e:
                await pm.scrape_pods(http, targets[1:], 2, 50.0)
            assert e.value.reason == "PodMetricsUnreachable"
            assert "b: HTTP 503" in e.value.message

    asyncio.run(run())


def test_garbage_from_prometheus_is_a_metrics_error() -> None:
    with pytest.raises(pm.MetricsError, match="unexpected sample"):
        pm.rows_from_prometheus(_matrix(_series("a", pm.KV_METRIC, [(1.0, "many")])))


def test_router_activity_from_the_routers_own_metrics() -> None:
    """The router's registry, as it exposes it, read the way the autoscaler reads it."""
    from prometheus_client import generate_latest

    from kvscale.operator.scaling import RouterActivity
    from kvscale.router.metrics import RouterMetrics

    a, b = RouterMetrics(), RouterMetrics()
    a.held.set(2)
    a.inflight.labels("http://10.0.0.1:8000").set(1)
    a.inflight.labels("http://10.0.0.2:8000").set(3)
    a.last_request.set(900.0)
    b.last_request.set(950.0)
    rows = [
        *pm.rows_from_exposition("router-a", generate_latest(a.registry).decode(), 1000.0,
                                 pm.ROUTER_METRICS),
        *pm.rows_from_exposition("router-b", generate_latest(b.registry).decode(), 1000.0,
                                 pm.ROUTER_METRICS),
    ]  # fmt: skip
    assert pm.router_activity(rows, ["router-a", "router-b"], 1000.0, 45.0) == RouterActivity(
        held=2, inflight=4, last_request=950.0, routers=2
    )
    # a stale router's rows do not count; none fresh: unknown, not idle
    assert pm.router_activity(rows, ["router-a"], 1046.0, 45.0) is None
    stale = pm.rows_from_prometheus(
        _matrix(_series("router-a", pm.HELD_METRIC, [(900.0, "4")])), pm.ROUTER_METRICS
    )
    assert pm.router_activity(stale, ["router-a"], 1000.0, 45.0) is None
