"""The router's Prometheus metrics, ``kvscale_router:`` prefix (the server's style:
one registry per app, labels ``replica``, ``outcome``, ``reason``, ``kind``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvscale.router.endpoints import Replica

PREFIX = "kvscale_router:"

HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# the chosen replica's (load + 1) / bound: above 1.0 only when every replica was over its
# bound (every KV cache past the threshold)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "Requests proxied, by replica and outcome (2xx/4xx/5xx: the replica's status, "
            "answered in full; client_disconnect; upstream_error: the replica failed "
            "mid-response; no_replica: 503 after holding, replica empty).",
            ["replica", "outcome"],
            registry=r,
        )
        self.decisions = Counter(
            PREFIX + "routing_decisions",
            "Replica choices by reason: prefix_hit (the prefix's home replica), "
            "load_bound_exceeded (the home was over its bound), no_prefix (shorter than one "
            "block: least loaded), least_loaded, random (those policies).",
            ["reason"],
            registry=r,
        )
        self.load_ratio = Histogram(
            PREFIX + "decision_load_ratio",
            "The chosen replica's (load + 1) / load bound at the time of the choice.",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.held = Gauge(
            PREFIX + "held_requests", "Requests waiting for a ready replica.", registry=r
        )
        self.last_request = Gauge(
            PREFIX + "last_request_timestamp_seconds",
            "Unix time of the latest request to /v1 (the router's start before any): the "
            "autoscaler scales to zero after a quiet window.",
            registry=r,
        )
        self.last_request.set_to_current_time()
        self.hold_time = Histogram(
            PREFIX + "hold_time_seconds",
            "Time requests waited for a ready replica (those that had to wait).",
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            PREFIX + "upstream_errors",
            "Failed attempts at a replica: connect (refused or reset before any response "
            "byte; retried on another replica), unavailable (a 503, e.g. draining; retried "
            "elsewhere) and midstream (after bytes were sent; not retried).",
            ["replica", "kind"],
            registry=r,
        )
        self.retries = Counter(
            PREFIX + "retries", "Requests sent again to another replica.", registry=r
        )
        self.replica_ready = Gauge(
            PREFIX + "replica_ready", "1 while the replica is in the rotation.", ["replica"],
            registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            PREFIX + "replica_inflight",
            "Requests the router has in flight at the replica.",
            ["replica"],
            registry=r,
        )
        self.reported = Gauge(
            PREFIX + "replica_reported_requests",
            "Requests running or waiting at the replica beyond this router's own, as its "
            "/metrics last said (other routers' requests): the balancer's load is this plus "
            "replica_inflight.",
            ["replica"],
            registry=r,
        )
        self.kv_usage = Gauge(
            PREFIX + "replica_kv_cache_usage",
            "The replica's KV-cache usage (0-1) as its /metrics last said.",
            ["replica"],
            registry=r,
        )

    def observe_replicas(self, replicas: Iterable[Replica]) -> None:
        """The load the balancer sees, set at scrape time (replicas that left drop out)."""
        self.reported.clear()
        self.kv_usage.clear()
        for x in replicas:
            self.reported.labels(x.url).set(x.others)
            self.kv_usage.labels(x.url).set(x.kv_usage)
