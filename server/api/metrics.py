"""Prometheus metrics with vLLM's meanings under the ``kvscale:`` prefix.

Gauges and counters are read from the engine's stats snapshot when Prometheus scrapes
(a custom collector, so they can never drift from the engine). Histograms are fed by
``RequestTimer``, which the API server calls after every engine step. Every series carries
the ``model_name`` label (the first served model name).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvscale.server.engine.core_outputs import EngineStats
from kvscale.server.outputs import RequestOutput

PREFIX = "kvscale:"

# Bucket bounds as in vLLM's server (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return out
            out.append(float(v))
        exp += 1


# name (without prefix) -> (type, help); the README's table lists the same.
METRICS: dict[str, tuple[str, str]] = {
    "num_requests_running": ("gauge", "Sequences in the running batch."),
    "num_requests_waiting": ("gauge", "Sequences waiting to be scheduled (incl. preempted)."),
    "kv_cache_usage_perc": (
        "gauge",
        "Fraction of KV-cache blocks held by live sequences, 0..1 (cached free blocks are free).",
    ),
    "kv_cache_blocks_total": ("gauge", "KV-cache blocks in the pool."),
    "kv_cache_blocks_free": ("gauge", "KV-cache blocks free (including cached, evictable ones)."),
    "prompt_tokens": ("counter", "Prompt tokens processed."),
    "generation_tokens": ("counter", "Tokens generated."),
    "request_success": ("counter", "Finished sequences by finish reason (stop, length, abort)."),
    "num_preemptions": ("counter", "Sequences preempted (KV blocks freed, recomputed later)."),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("counter", "Prompt tokens found in the prefix cache."),
    "spec_decode_num_drafts": (
        "counter",
        "Speculative verify rows (a sequence's drafts in a step).",
    ),
    "spec_decode_num_draft_tokens": ("counter", "Tokens drafted for verification."),
    "spec_decode_num_accepted_tokens": ("counter", "Drafted tokens accepted by verification."),
    "spec_decode_num_accepted_tokens_per_pos": (
        "counter",
        "Drafted tokens accepted, by position in the draft (0-based).",
    ),
    "spec_decode_draft_available": (
        "gauge",
        "1 while the draft sidecar answers, 0 while the server runs without speculation.",
    ),
    "spec_decode_draft_failures": ("counter", "Proposal calls the draft sidecar failed."),
    "time_to_first_token_seconds": ("histogram", "Arrival to first generated token."),
    "inter_token_latency_seconds": ("histogram", "Time between two tokens of a sequence."),
    "e2e_request_latency_seconds": ("histogram", "Arrival to last token of a request."),
    "request_queue_time_seconds": ("histogram", "Arrival to first scheduled."),
    "request_prompt_tokens": ("histogram", "Prompt length of finished requests (tokens)."),
    "request_generation_tokens": ("histogram", "Tokens generated per finished request."),
}


class _EngineCollector(Collector):
    """Gauges and counters from the latest EngineStats (None before the model loaded)."""

    def __init__(
        self, model_name: str, stats: Callable[[], tuple[EngineStats, int] | None]
    ) -> None:
        self.model_name = model_name
        self._stats = stats

    def _family(self, cls: type, name: str) -> Metric:
        return cls(PREFIX + name, METRICS[name][1], labels=["model_name"])

    def collect(self) -> Iterable[Metric]:
        got = self._stats()
        if got is None:
            return
        s, waiting = got
        label = [self.model_name]
        gauges = {
            "num_requests_running": s.num_running,
            "num_requests_waiting": waiting,
            "kv_cache_usage_perc": s.kv_cache_usage,
            "kv_cache_blocks_total": s.kv_blocks_total,
            "kv_cache_blocks_free": s.kv_blocks_free,
        }
        for name, value in gauges.items():
            g = self._family(GaugeMetricFamily, name)
            g.add_metric(label, float(value))
            yield g
        counters = {
            "prompt_tokens": s.prompt_tokens,
            "generation_tokens": s.generation_tokens,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
        }
        for name, value in counters.items():
            c = self._family(CounterMetricFamily, name)
            c.add_metric(label, float(value))
            yield c
        yield from self._spec(s, label)
        c = CounterMetricFamily(
            PREFIX + "request_success",
            METRICS["request_success"][1],
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted({"stop", "length", "abort", *s.finished}):
            c.add_metric([self.model_name, reason], float(s.finished.get(reason, 0)))
        yield c

    def _spec(self, s: EngineStats, label: list[str]) -> Iterable[Metric]:
        """Speculative decoding's series (only when the server speculates)."""
        if not s.spec_accepted_per_pos:
            return
        for name, value in (
            ("spec_decode_num_drafts", s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", s.spec_num_accepted_tokens),
            ("spec_decode_draft_failures", s.spec_draft_failures),
        ):
            c = self._family(CounterMetricFamily, name)
            c.add_metric(label, float(value))
            yield c
        name = "spec_decode_num_accepted_tokens_per_pos"
        c = CounterMetricFamily(PREFIX + name, METRICS[name][1], labels=["model_name", "position"])
        for pos, value in enumerate(s.spec_accepted_per_pos):
            c.add_metric([self.model_name, str(pos)], float(value))
        yield c
        if s.spec_draft_available is not None:
            g = self._family(GaugeMetricFamily, "spec_decode_draft_available")
            g.add_metric(label, float(s.spec_draft_available))
            yield g


@dataclass
class _Timing:
    arrival: float
    first_token_seen: bool = False
    counts: dict[int, int] = field(default_factory=dict)  # choice index -> tokens seen
    last: dict[int, float] = field(default_factory=dict)  # choice index -> time of last token


class ServerMetrics:
    """The registry behind ``GET /metrics`` and the engine observer that fills histograms."""

    def __init__(self, model_name: str, max_model_len: int = 1 << 20) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats_fn: Callable[[], tuple[EngineStats, int] | None] = lambda: None
        self.registry.register(_EngineCollector(model_name, lambda: self._stats_fn()))

        def hist(name: str, buckets: Iterable[float]) -> Histogram:
            h = Histogram(
                PREFIX + name,
                METRICS[name][1],
                labelnames=["model_name"],
                registry=self.registry,
                buckets=list(buckets),
            )
            return h.labels(model_name)

        lens = token_buckets(max_model_len)
        self.ttft = hist("time_to_first_token_seconds", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", lens)
        self.generation_len = hist("request_generation_tokens", lens)
        self.timer = RequestTimer(self)

    def bind_stats(self, fn: Callable[[], tuple[EngineStats, int] | None]) -> None:
        """``fn() -> (stats, waiting sequences)`` is read at every scrape."""
        self._stats_fn = fn


class RequestTimer:
    """Engine observer (runs on the event loop): per-request timestamps -> histograms."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics
        self._reqs: dict[str, _Timing] = {}
        self._lock = threading.Lock()

    def on_add(self, request_id: str, arrival_time: float) -> None:
        with self._lock:
            self._reqs[request_id] = _Timing(arrival_time)

    def on_abort(self, request_id: str) -> None:
        with self._lock:
            self._reqs.pop(request_id, None)

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        m = self.m
        for out in outputs:
            with self._lock:
                t = self._reqs.get(out.request_id)
            if t is None:
                continue
            for c in out.outputs:
                n, prev = len(c.token_ids), t.counts.get(c.index, 0)
                if n <= prev:
                    continue
                if prev == 0:
                    if not t.first_token_seen:
                        t.first_token_seen = True
                        m.ttft.observe(max(0.0, now - t.arrival))
                else:
                    gap = (now - t.last[c.index]) / (n - prev)
                    for _ in range(n - prev):
                        m.itl.observe(max(0.0, gap))
                t.counts[c.index] = n
                t.last[c.index] = now
            if out.finished:
                with self._lock:
                    self._reqs.pop(out.request_id, None)
                mx = out.metrics
                m.e2e.observe(max(0.0, now - t.arrival))
                if "first_scheduled_time" in mx:
                    m.queue_time.observe(max(0.0, mx["first_scheduled_time"] - t.arrival))
                m.prompt_len.observe(len(out.prompt_token_ids))
                m.generation_len.observe(sum(len(c.token_ids) for c in out.outputs))

    @property
    def num_tracked(self) -> int:
        """Requests with timing state (for tests: must drop to 0 when idle)."""
        return len(self._reqs)
