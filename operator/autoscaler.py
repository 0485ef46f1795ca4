"""The autoscaler of one LLMDeployment: a loop (:func:`run`) of evaluations (:func:`evaluate`).

Each evaluation (every ``spec.autoscaling.intervalSeconds``, default 15 s; the loop is
started and stopped by :mod:`kvscale.operator.handlers`):

1. Reads the LLMDeployment; only the holder of its Lease goes on (:mod:`.leader`).
2. Takes the current count from the Deployment's ``spec.replicas`` and the ready pods from
   the API (by the operator's selector label), then their KV-cache usage and queue depth
   from Prometheus or their own ``/metrics`` (:mod:`.podmetrics`).
3. Decides with :func:`kvscale.operator.scaling.decide` (HPA semantics).
4. Writes ``status``: ``desiredReplicas``, ``lastScaleTime`` and ``lastScaleReason`` when it
   scales, the observed ``kvCacheUsagePercent`` / ``queueDepthPerReplica`` and the
   ``ScalingActive`` condition (False with the reason when metrics cannot be read: replicas
   stay). Then, like an HPA, it sets the LLMDeployment's ``spec.replicas`` through its scale
   subresource, and runs the normal reconcile pass, which scales the Deployment to
   ``status.desiredReplicas``. Each scaling posts a ``SuccessfulRescale`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvscale.operator import constants as c
from kvscale.operator import podmetrics, render, telemetry
from kvscale.operator.config import OperatorConfig
from kvscale.operator.kube import DEPLOYMENTS, PODS, ApiError, KubeClient
from kvscale.operator.leader import LeaseLock
from kvscale.operator.reconcile import LLMDEPLOYMENTS, Conflict, now_iso, reconcile
from kvscale.operator.scaling import (
    Decision,
    History,
    PodSample,
    Policy,
    RouterActivity,
    decide,
    zero_decision,
)
from kvscale.operator.spec import AutoscalingSpec, SpecError, parse_spec
from kvscale.operator.status import condition, set_condition

Obj = dict[str, Any]
Event = tuple[str, str, str]  # (type, reason, message)
VALID = "ValidMetricFound"  # ScalingActive's reason while metrics flow (as the HPA's)
NO_READY_PODS = "NoReadyPods"  # False, but expected while pods start: no Warning event
ROUTER_UNAVAILABLE = "RouterMetricsUnavailable"  # scale from zero cannot see held requests
NO_READY_ROUTER = "NoReadyRouter"  # as NO_READY_PODS: expected while the router starts
QUIET_ERRORS = (NO_READY_PODS, NO_READY_ROUTER)


@dataclass
class AutoscalerState:
    """What one LLMDeployment's loop remembers between evaluations (in memory only)."""

    history: History = ()
    leader: bool = False
    failing: str | None = None  # the reason of the current metrics failure, if any


@dataclass
class Evaluation:
    """The result of one evaluation, for the loop, the logs and the tests."""

    interval_s: float
    llmd: Obj | None = None  # the freshest body (events are posted on it)
    leader: bool = False
    decision: Decision | None = None
    events: list[Event] = field(default_factory=list)


def interval_for(auto: AutoscalingSpec, config: OperatorConfig) -> float:
    """Seconds between evaluations: the spec's, else the operator's default."""
    return float(auto.interval_seconds or config.autoscale_interval_seconds)


def lease_duration(interval_s: float) -> int:
    """A holder renews every interval; others take over after three missed renewals, and
    never sooner than Kubernetes' own leader election does (15 s): a leader whose loop
    stalls for a few seconds on a busy node keeps its lease instead of flapping."""
    return max(15, round(3 * interval_s))


def policy_for(auto: AutoscalingSpec, interval_s: float) -> Policy:
    """The HPA-like decision's policy; with minReplicas 0 its floor is 1 (only
    :func:`~kvscale.operator.scaling.zero_decision` goes to or from 0)."""
    return Policy(
        min_replicas=max(1, auto.min_replicas),
        max_replicas=auto.max_replicas,
        target_kv_usage=auto.target_kv_cache_utilization_percent / 100,
        target_queue_depth=float(auto.target_queue_depth_per_replica),
        tolerance=auto.tolerance_percent / 100,
        scale_up_limit_percent=auto.scale_up_limit_percent,
        scale_up_window_s=float(auto.scale_up_stabilization_window_seconds),
        scale_down_window_s=float(auto.scale_down_stabilization_window_seconds),
        max_sample_age_s=float(auto.max_metric_age_seconds or 3 * interval_s),
    )


async def read_samples(
    http: aiohttp.ClientSession,
    prometheus_url: str | None,
    namespace: str,
    pods: list[Mapping[str, Any]],
    policy: Policy,
    timeout_s: float,
    now: float,
) -> list[PodSample]:
    """Samples of the ready ``pods``; raises :class:`podmetrics.MetricsError`."""
    names = [p["metadata"]["name"] for p in pods]
    if prometheus_url:
        rows = await podmetrics.query_prometheus(
            http, prometheus_url, namespace, names, policy.max_sample_age_s, timeout_s, at=now
        )
    else:
        targets = [podmetrics.scrape_target(p) for p in pods]
        rows = await podmetrics.scrape_pods(http, targets, timeout_s, now)
    return podmetrics.samples_from_rows(rows, names)


async def read_router_activity(
    http: aiohttp.ClientSession,
    prometheus_url: str | None,
    namespace: str,
    pods: list[Mapping[str, Any]],
    max_age_s: float,
    timeout_s: float,
    now: float,
) -> RouterActivity:
    """The ready router pods' held and in-flight requests and newest request time; raises
    :class:`podmetrics.MetricsError` when none can be read."""
    names = [p["metadata"]["name"] for p in pods]
    if not names:
        raise podmetrics.MetricsError(NO_READY_ROUTER, "no router pod is ready yet")
    routers = podmetrics.ROUTER_METRICS
    if prometheus_url:
        rows = await podmetrics.query_prometheus(
            http, prometheus_url, namespace, names, max_age_s, timeout_s, at=now, names=routers
        )
    else:
        targets = [podmetrics.scrape_target(p) for p in pods]
        rows = await podmetrics.scrape_pods(http, targets, timeout_s, now, routers)
    activity = podmetrics.router_activity(rows, names, now, max_age_s)
    if activity is None:
        raise podmetrics.MetricsError(
            ROUTER_UNAVAILABLE, f"no fresh metrics from the {len(names)} ready router pods"
        )
    return activity


def _observed(decision: Decision) -> dict[str, Any]:
    kv, queue = decision.kv_usage, decision.queue_depth
    return {
        "kvCacheUsagePercent": None if kv is None else round(kv * 100),
        "queueDepthPerReplica": None if queue is None else round(queue, 2),
    }


def status_update(
    status: Mapping[str, Any],
    decision: Decision,
    error_reason: str | None,
    generation: int | None,
    now: str,
    held: int | None = None,
) -> dict[str, Any]:
    """The merge patch of the autoscaler's status fields (empty when nothing changed).
    ``held``: requests the router holds (scale from zero), None when not read."""
    want: dict[str, Any] = _observed(decision) if decision.metrics_ok else {}
    if not decision.metrics_ok:
        want = {"kvCacheUsagePercent": None, "queueDepthPerReplica": None}
    want["heldRequests"] = held
    if decision.desired != decision.current:
        want.update(
            desiredReplicas=decision.desired, lastScaleTime=now, lastScaleReason=decision.reason
        )
    cond = condition(
        c.SCALING_ACTIVE,
        decision.metrics_ok,
        VALID if decision.metrics_ok else (error_reason or "FailedGetMetrics"),
        decision.reason,
        generation,
    )
    want["conditions"] = set_condition(status.get("conditions"), cond, now)
    return {k: v for k, v in want.items() if status.get(k) != v}


async def write_decision(
    api: KubeClient,
    config: OperatorConfig,
    llmd: Obj,
    decision: Decision,
    error: str | None,
    held: int | None = None,
) -> tuple[Obj, list[Event]]:
    """Status, then the scale subresource, then a reconcile pass; returns the freshest body
    and the events to post. Raises :class:`Conflict` when the object changed meanwhile."""
    meta = llmd["metadata"]
    ns, name = meta["namespace"], meta["name"]
    now = now_iso()
    events: list[Event] = []
    status = llmd.get("status") or {}
    patch = status_update(status, decision, error, meta.get("generation"), now, held)
    try:
        if patch:
            body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": patch}
            llmd = await api.patch(LLMDEPLOYMENTS.path(ns, name, "status"), body)
        if decision.metrics_ok and (llmd.get("spec") or {}).get("replicas") != decision.desired:
            scale = {"spec": {"replicas": decision.desired}}
            await api.patch(LLMDEPLOYMENTS.path(ns, name, "scale"), scale)
    except ApiError as e:
        if e.status == 409:
            raise Conflict(f"LLMDeployment {ns}/{name} changed while writing the decision") from e
        raise
    if decision.desired != decision.current:
        events.append(
            ("Normal", "SuccessfulRescale", f"New size: {decision.desired}; {decision.reason}")
        )
        fresh = await api.get(LLMDEPLOYMENTS.path(ns, name))
        if fresh is not None:
            llmd = fresh
            events += (await reconcile(api, fresh, config)).events
    return llmd, events


async def evaluate(
    api: KubeClient,
    http: aiohttp.ClientSession,
    lease: LeaseLock,
    config: OperatorConfig,
    state: AutoscalerState,
    namespace: str,
    name: str,
    lock: contextlib.AbstractAsyncContextManager[Any] | None = None,
    now: float | None = None,
) -> Evaluation:
    """One evaluation (see the module docstring); API errors propagate."""
    default = Evaluation(config.autoscale_interval_seconds)
    llmd = await api.get(LLMDEPLOYMENTS.path(namespace, name))
    if llmd is None or llmd["metadata"].get("deletionTimestamp"):
        return default
    try:
        spec = parse_spec(llmd.get("spec"))
    except SpecError:
        return default  # the reconcile pass reports it
    auto = spec.autoscaling
    interval = interval_for(auto, config)
    out = Evaluation(interval, llmd)
    if not auto.enabled:
        return out
    out.leader = state.leader = await lease.acquire(llmd, lease_duration(interval))
    if not out.leader:
        state.history = ()  # a later leadership starts afresh (seeded with the current count)
        return out
    deployment = await api.get(DEPLOYMENTS.path(namespace, name))
    if deployment is None:
        return out  # the reconcile pass creates it
    current = int(deployment["spec"].get("replicas", 1))
    pods = await api.list(PODS.path(namespace), render.selector_string(name))
    ready = [p for p in pods if podmetrics.is_ready(p)]
    policy = policy_for(auto, interval)
    now = time.time() if now is None else now
    timeout = max(1.0, min(10.0, interval))
    prometheus = auto.prometheus_url or config.prometheus_url
    error: str | None = None
    activity: RouterActivity | None = None
    zero: Decision | None = None
    try:
        if auto.min_replicas == 0:
            routers = await api.list(PODS.path(namespace), render.router_selector_string(name))
            try:
                activity = await read_router_activity(
                    http,
                    prometheus,
                    namespace,
                    [p for p in routers if podmetrics.is_ready(p)],
                    policy.max_sample_age_s,
                    timeout,
                    now,
                )
            except podmetrics.MetricsError:
                if current == 0:
                    raise  # nothing else can say when to start a replica
            if activity is not None:
                zero = zero_decision(current, activity, auto.scale_to_zero_after_seconds, now)
        if zero is not None:
            decision = zero
            state.history = ()  # the next decision above zero starts afresh
        elif not ready:
            raise podmetrics.MetricsError(
                NO_READY_PODS, f"no ready pod to read metrics from yet ({len(pods)} pods)"
            )
        else:
            samples = await read_samples(http, prometheus, namespace, ready, policy, timeout, now)
            decision, state.history = decide(policy, current, samples, state.history, now)
            if not decision.metrics_ok:
                error = "MissingMetrics"
    except podmetrics.MetricsError as e:
        error = e.reason
        reason = f"{e.message}; keeping {current} replicas"
        decision = Decision(current, current, reason, None, None, None, None, 0, False)
    out.decision = decision
    if error and error not in QUIET_ERRORS and state.failing != error:
        out.events.append(("Warning", "FailedGetMetrics", decision.reason))
    state.failing = error
    async with lock or contextlib.nullcontext():
        for attempt in (1, 2):
            try:
                held = activity.held if activity is not None else None
                out.llmd, events = await write_decision(
                    api, config, out.llmd, decision, error, held
                )
                break
            except Conflict:
                fresh = await api.get(LLMDEPLOYMENTS.path(namespace, name))
                if attempt == 2 or fresh is None:
                    raise
                out.llmd = fresh
    out.events += events
    if error:
        telemetry.ERRORS.labels(error).inc()
    else:
        telemetry.DECISIONS.labels(decision.direction).inc()
    telemetry.DESIRED.labels(namespace, name).set(decision.desired)
    telemetry.LAST_RECONCILE.labels(namespace, name).set(time.time())
    return out


PostEvent = Callable[[Obj, str, str, str], None]  # (body, type, reason, message)


async def run(
    api: KubeClient,
    http: aiohttp.ClientSession,
    config: OperatorConfig,
    namespace: str,
    name: str,
    stop: asyncio.Event,
    lock: contextlib.AbstractAsyncContextManager[Any],
    post_event: PostEvent,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """Evaluate every interval until ``stop`` is set; errors are logged and retried next
    interval. On the way out the Lease is released, so another replica takes over at once."""
    state = AutoscalerState()
    lease = LeaseLock(api, config.identity)
    loop = asyncio.get_running_loop()
    interval = config.autoscale_interval_seconds
    logger.info("autoscaler started (%s)", config.identity)
    try:
        while not stop.is_set():
            started = loop.time()
            try:
                result = await evaluate(api, http, lease, config, state, namespace, name, lock=lock)
                interval = result.interval_s
                telemetry.LEADER.labels(namespace, name).set(1 if result.leader else 0)
                if result.decision is not None:
                    logger.debug("autoscaler: %s", result.decision.reason)
                for type_, reason, message in result.events:
                    if result.llmd is not None:
                        post_event(result.llmd, type_, reason, message)
            except (ApiError, Conflict, aiohttp.ClientError, TimeoutError) as e:
                telemetry.ERRORS.labels(type(e).__name__).inc()
                logger.warning("autoscaler evaluation failed, retrying next interval: %s", e)
            except Exception as e:  # a bug must not end the loop: log it, try again
                telemetry.ERRORS.labels(type(e).__name__).inc()
                logger.exception("autoscaler evaluation crashed, retrying next interval")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, interval - (loop.time() - started)))
    finally:
        telemetry.forget(namespace, name)
        if state.leader:
            body = {"metadata": {"namespace": namespace, "name": name}}
            try:
                await asyncio.wait_for(lease.release(body), timeout=5)
            except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                logger.info("could not release the autoscaler Lease: %s", e)
        logger.info("autoscaler stopped")
