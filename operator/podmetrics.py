"""Per-pod KV-cache usage and queue depth, from Prometheus or from the pods themselves.

Both sources end in the same code path: each yields :class:`Row` s (pod, metric, value,
scrape time), and :func:`samples_from_rows` turns rows into the decision's
:class:`~kvscale.operator.scaling.PodSample` s.

* Prometheus (``spec.autoscaling.prometheusUrl`` or the operator's default): one instant
  query of a range selector over the sample-age window,
  ``{__name__=~"kvscale:kv_cache_usage_perc|kvscale:num_requests_waiting",
  namespace="NS", pod=~"POD1|POD2"}[45s]``, so every series comes with its raw samples and
  their scrape times; the newest one counts and a series with none in the window is missing
  (stale). Prometheus must attach the ``namespace`` and ``pod`` target labels, as the
  chart's ServiceMonitor, kube-prometheus PodMonitors and the usual ``kubernetes-pods``
  scrape job do.
* No Prometheus: ``GET http://POD_IP:PORT/metrics`` of every ready pod, with the port and
  path from the ``prometheus.io/port`` / ``prometheus.io/path`` annotations the operator puts
  on its pods (else the ``http`` container port, else 8000), parsed with
  ``prometheus_client``'s text-format parser.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvscale.operator import constants as c
from kvscale.operator.scaling import PodSample, RouterActivity

KV_METRIC = "kvscale:kv_cache_usage_perc"
QUEUE_METRIC = "kvscale:num_requests_waiting"
METRICS = (KV_METRIC, QUEUE_METRIC)
# The router pods' (spec.router), for scaling from and to zero.
HELD_METRIC = "kvscale_router:held_requests"
INFLIGHT_METRIC = "kvscale_router:replica_inflight"
LAST_REQUEST_METRIC = "kvscale_router:last_request_timestamp_seconds"
ROUTER_METRICS = (HELD_METRIC, INFLIGHT_METRIC, LAST_REQUEST_METRIC)
_RE_SPECIAL = re.compile(r"([\\.^$*+?()\[\]{}|])")


class MetricsError(Exception):
    """No metrics could be read; ``reason`` is CamelCase for conditions and counters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Row:
    """One series' newest sample."""

    pod: str
    metric: str
    value: float
    timestamp: float  # unix seconds of the scrape


@dataclass(frozen=True)
class PodTarget:
    """Where a ready pod serves its metrics."""

    name: str
    url: str  # http://10.1.2.3:8000/metrics


# --- which pods count ------------------------------------------------------------------------


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True, an IP, and not being deleted."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    ready = any(
        cond.get("type") == "Ready" and cond.get("status") == "True"
        for cond in status.get("conditions") or ()
    )
    return ready and bool(status.get("podIP"))


def scrape_target(pod: Mapping[str, Any]) -> PodTarget:
    """The pod's metrics URL: its IP with the Prometheus annotations' port, path and scheme."""
    meta = pod.get("metadata", {})
    notes = meta.get("annotations") or {}
    port = notes.get("prometheus.io/port")
    if not port:
        ports = [
            p
            for ctr in (pod.get("spec") or {}).get("containers") or ()
            for p in ctr.get("ports") or ()
        ]
        named = [p.get("containerPort") for p in ports if p.get("name") == "http"]
        port = named[0] if named else c.SERVER_PORT
    path = notes.get("prometheus.io/path") or "/metrics"
    scheme = notes.get("prometheus.io/scheme") or "http"
    host = pod["status"]["podIP"]
    host = f"[{host}]" if ":" in host else host
    return PodTarget(meta["name"], f"{scheme}://{host}:{port}{path}")


# --- parsing: both sources end here -----------------------------------------------------------


def rows_from_exposition(
    pod: str, text: str, scraped_at: float, names: Sequence[str] = METRICS
) -> list[Row]:
    """The gauges ``names`` of one pod's ``/metrics`` text (Prometheus text format)."""
    rows = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                ts = sample.timestamp if sample.timestamp is not None else scraped_at
                rows.append(Row(pod, sample.name, float(sample.value), float(ts)))
    return rows


def rows_from_prometheus(payload: Mapping[str, Any], names: Sequence[str] = METRICS) -> list[Row]:
    """A Prometheus ``/api/v1/query`` answer (vector or matrix) -> the newest sample per
    series of ``names``; series without a ``pod`` label are ignored."""
    if payload.get("status") != "success":
        raise MetricsError(
            "PrometheusQueryFailed",
            f"Prometheus answered {payload.get('errorType', 'error')}: "
            f"{payload.get('error', payload)}",
        )
    data = payload.get("data") or {}
    kind = data.get("resultType")
    if kind not in ("vector", "matrix"):
        raise MetricsError("PrometheusQueryFailed", f"unexpected Prometheus result type {kind!r}")
    rows = []
    for series in data.get("result") or ():
        labels = series.get("metric") or {}
        pod, name = labels.get("pod"), labels.get("__name__")
        point = series.get("value") if kind == "vector" else (series.get("values") or [None])[-1]
        if not pod or name not in names or not point:
            continue
        try:
            rows.append(Row(pod, name, float(point[1]), float(point[0])))
        except (TypeError, ValueError, IndexError) as e:
            raise MetricsError("PrometheusQueryFailed", f"unexpected sample {point!r}") from e
    return rows


def samples_from_rows(rows: Iterable[Row], pods: Sequence[str]) -> list[PodSample]:
    """One sample per pod in ``pods``: KV usage is the highest of its series, queue depth the
    sum, the timestamp the oldest of its series; NaN values and other pods are dropped."""
    kv: dict[str, float] = {}
    queue: dict[str, float] = {}
    when: dict[str, float] = {}
    wanted = set(pods)
    for row in rows:
        if row.pod not in wanted or math.isnan(row.value):
            continue
        if row.metric == KV_METRIC:
            kv[row.pod] = max(kv.get(row.pod, 0.0), min(max(row.value, 0.0), 1.0))
        else:
            queue[row.pod] = queue.get(row.pod, 0.0) + max(row.value, 0.0)
        when[row.pod] = min(when.get(row.pod, row.timestamp), row.timestamp)
    return [PodSample(p, kv.get(p), queue.get(p), when.get(p)) for p in pods]


def router_activity(
    rows: Iterable[Row], pods: Sequence[str], now: float, max_age: float
) -> RouterActivity | None:
    """The routers' summed held and in-flight requests and their newest request time, from
    the fresh rows of the router pods ``pods``; None when no router pod has fresh rows."""
    wanted = set(pods)
    fresh = [
        r
        for r in rows
        if r.pod in wanted and now - r.timestamp <= max_age and not math.isnan(r.value)
    ]
    if not fresh:
        return None
    held = sum(r.value for r in fresh if r.metric == HELD_METRIC)
    inflight = sum(r.value for r in fresh if r.metric == INFLIGHT_METRIC)
    last = [r.value for r in fresh if r.metric == LAST_REQUEST_METRIC]
    return RouterActivity(
        held=round(max(held, 0.0)),
        inflight=round(max(inflight, 0.0)),
        last_request=max(last) if last else None,
        routers=len({r.pod for r in fresh}),
    )


# --- fetching ---------------------------------------------------------------------------------


def _alternatives(names: Sequence[str]) -> str:
    """An RE2 ``a|b`` matching exactly these names, as the content of a PromQL string
    (regex metacharacters escaped, then backslashes and quotes escaped for PromQL)."""
    regex = "|".join(_RE_SPECIAL.sub(r"\\\1", n) for n in names)
    return regex.replace("\\", "\\\\").replace('"', '\\"')


def promql(
    namespace: str, pods: Sequence[str], window_s: float, names: Sequence[str] = METRICS
) -> str:
    """The range-selector query for these pods' gauges ``names`` over ``window_s``."""
    return (
        f'{{__name__=~"{_alternatives(names)}",namespace="{namespace}",'
        f'pod=~"{_alternatives(pods)}"}}[{max(1, math.ceil(window_s))}s]'
    )


async def query_prometheus(
    session: aiohttp.ClientSession,
    base_url: str,
    namespace: str,
    pods: Sequence[str],
    window_s: float,
    timeout_s: float,
    at: float | None = None,
    names: Sequence[str] = METRICS,
) -> list[Row]:
    """Rows of the gauges ``names`` for ``pods`` from Prometheus, evaluated at unix time
    ``at`` (default: its now); raises :class:`MetricsError` when it cannot."""
    if not pods:
        return []
    url = base_url.rstrip("/") + "/api/v1/query"
    params = {"query": promql(namespace, pods, window_s, names)}
    if at is not None:
        params["time"] = f"{at:.3f}"
    try:
        async with session.get(
            url, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as rsp:
            text = await rsp.text()
            try:
                payload = await rsp.json(content_type=None)
            except ValueError:
                payload = None
            if not isinstance(payload, dict):
                raise MetricsError(
                    "PrometheusQueryFailed",
                    f"Prometheus at {base_url} answered HTTP {rsp.status}: {text[:200]}",
                )
    except (aiohttp.ClientError, TimeoutError) as e:
        raise MetricsError(
            "PrometheusUnreachable",
            f"cannot reach Prometheus at {base_url}: {type(e).__name__} {e}".rstrip()
            + "; check spec.autoscaling.prometheusUrl or the chart's prometheusUrl",
        ) from e
    return rows_from_prometheus(payload, names)


async def _scrape_one(
    session: aiohttp.ClientSession,
    target: PodTarget,
    timeout_s: float,
    now: float,
    names: Sequence[str],
) -> list[Row] | str:
    try:
        async with session.get(target.url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as rsp:
            if rsp.status != 200:
                return f"{target.name}: HTTP {rsp.status}"
            text = await rsp.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"{target.name}: {type(e).__name__} {e}".rstrip()
    try:
        return rows_from_exposition(target.name, text, now, names)
    except ValueError as e:
        return f"{target.name}: not Prometheus text format ({e})"


async def scrape_pods(
    session: aiohttp.ClientSession,
    targets: Sequence[PodTarget],
    timeout_s: float,
    now: float,
    names: Sequence[str] = METRICS,
) -> list[Row]:
    """Rows of the gauges ``names`` from every target's ``/metrics``; a pod that fails is
    simply missing, and only when every pod fails is it an error."""
    results = await asyncio.gather(
        *(_scrape_one(session, t, timeout_s, now, names) for t in targets)
    )
    rows = [row for r in results if not isinstance(r, str) for row in r]
    errors = [r for r in results if isinstance(r, str)]
    if targets and len(errors) == len(targets):
        raise MetricsError(
            "PodMetricsUnreachable",
            f"cannot read /metrics of any ready pod ({'; '.join(errors[:3])})",
        )
    return rows
