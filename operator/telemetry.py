"""The operator's own Prometheus metrics (``KVSCALE_METRICS_PORT``, chart value
``metricsPort``; ``GET /metrics`` on that port).

| metric | type | labels | meaning |
| --- | --- | --- | --- |
| ``kvscale_operator_autoscaler_decisions_total`` | counter | ``direction`` (up, down, none) | evaluations by outcome |
| ``kvscale_operator_autoscaler_errors_total`` | counter | ``reason`` | evaluations that could not decide (metrics unreadable, API errors) |
| ``kvscale_operator_autoscaler_last_reconcile_timestamp_seconds`` | gauge | ``namespace``, ``llmdeployment`` | unix time of the last completed evaluation |
| ``kvscale_operator_autoscaler_desired_replicas`` | gauge | ``namespace``, ``llmdeployment`` | replicas the last evaluation asked for |
| ``kvscale_operator_autoscaler_leader`` | gauge | ``namespace``, ``llmdeployment`` | 1 while this replica holds the autoscaler Lease |
"""  # noqa: E501

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
PREFIX = "kvscale_operator_autoscaler_"
OBJECT_LABELS = ("namespace", "llmdeployment")

DECISIONS = Counter(
    PREFIX + "decisions", "Autoscaler evaluations by outcome.", ["direction"], registry=REGISTRY
)
ERRORS = Counter(
    PREFIX + "errors",
    "Autoscaler evaluations that could not decide.",
    ["reason"],
    registry=REGISTRY,
)
LAST_RECONCILE = Gauge(
    PREFIX + "last_reconcile_timestamp_seconds",
    "Unix time of the last completed autoscaler evaluation.",
    OBJECT_LABELS,
    registry=REGISTRY,
)
DESIRED = Gauge(
    PREFIX + "desired_replicas",
    "Replicas the last autoscaler evaluation asked for.",
    OBJECT_LABELS,
    registry=REGISTRY,
)
LEADER = Gauge(
    PREFIX + "leader",
    "1 while this operator replica holds the LLMDeployment's autoscaler Lease.",
    OBJECT_LABELS,
    registry=REGISTRY,
)
for _direction in ("up", "down", "none"):
    DECISIONS.labels(_direction)  # export zeros from the start


def forget(namespace: str, name: str) -> None:
    """Drop one LLMDeployment's series (its autoscaler stopped)."""
    for gauge in (LAST_RECONCILE, DESIRED, LEADER):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass


def serve(port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` in a background thread; ``server.shutdown()`` stops it."""
    return start_http_server(port, addr=addr, registry=REGISTRY)
