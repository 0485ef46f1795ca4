"""The autoscaler's decision: a pure function of the policy, the current replica count, the
latest per-pod samples and the recent recommendations. No I/O, no clock: ``now`` is passed.

It follows the Kubernetes HPA algorithm (``replica_calculator.go`` and the ``behavior``
normalisation of ``horizontal.go``) for two average-value signals, KV-cache usage and queue
depth per replica:

1. Per signal, ``ratio = average / target`` over the pods with fresh data. Within the
   tolerance (``|ratio - 1| <= tolerance``) the signal recommends the current count; else
   ``ceil(ratio * replicas)``.
2. Replicas without data (not ready, not created yet, no or stale sample) are never counted
   as idle: when the measured pods ask for fewer replicas they count as exactly at target,
   when they ask for more they count as 0 (so the scale-up is not overstated). If that flips
   the direction or lands within the tolerance, the signal recommends the current count.
3. The largest recommendation wins. A signal without any data blocks a scale-down (as the
   HPA does when one of its metrics fails); with no data at all nothing changes.
4. Stabilization: the raw recommendation is recorded; the result is the current count moved
   no lower than the highest recommendation of the scale-down window and no higher than the
   lowest recommendation of the scale-up window. An empty history (operator restart, new
   leader, autoscaling just enabled) is seeded with the current count, so nothing scales
   down before a whole window has been observed.
5. Scale-up is limited per decision to ``+scale_up_limit_percent`` (at least one replica);
   the result is clamped to [min, max]. A current count outside [min, max] is brought back
   at once, before any metric is looked at.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

KV = "kv_cache"
QUEUE = "queue_depth"
ROUTER = "router"  # scale from / to zero on the router's held requests and quiet time
_EPS = 1e-9  # ceil(2.0000000001) must stay 2


@dataclass(frozen=True)
class Policy:
    """What the decision needs from ``spec.autoscaling`` (fractions, seconds)."""

    min_replicas: int
    max_replicas: int
    target_kv_usage: float  # average fraction of KV-cache blocks in use per replica, (0, 1]
    target_queue_depth: float  # average waiting requests per replica, > 0
    tolerance: float = 0.1  # no change while |average / target - 1| <= this
    scale_up_limit_percent: int = 100  # at most +this % per decision (and at least +1)
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    max_sample_age_s: float = 45.0  # older samples count as missing


@dataclass(frozen=True)
class PodSample:
    """One ready pod's latest reading; ``None`` values are missing data."""

    pod: str
    kv_usage: float | None  # fraction of KV blocks in use, 0..1
    queue_depth: float | None  # requests waiting
    timestamp: float | None  # unix seconds when it was scraped


@dataclass(frozen=True)
class Recommendation:
    timestamp: float  # unix seconds
    replicas: int


History = tuple[Recommendation, ...]


@dataclass(frozen=True)
class Signal:
    """One signal's view: its per-replica average and the replicas it asks for."""

    name: str
    average: float | None  # over the pods with data; None when no pod had any
    target: float
    replicas: int | None  # None without data
    text: str  # "avg KV usage 0.91 > target 0.70 on 2 replicas"


@dataclass(frozen=True)
class Decision:
    """The outcome of one evaluation."""

    current: int
    desired: int
    reason: str  # one line for people: "avg KV usage 0.91 > target 0.70 on 2 replicas -> 3"
    signal: str | None  # KV or QUEUE: the signal whose recommendation won
    recommendation: int | None  # the raw recommendation before stabilization and limits
    kv_usage: float | None  # per-replica average over pods with data, 0..1
    queue_depth: float | None  # per-replica average over pods with data
    measured: int  # pods with fresh data
    metrics_ok: bool  # False: no usable data, nothing changed

    @property
    def direction(self) -> str:
        """``up``, ``down`` or ``none``."""
        if self.desired > self.current:
            return "up"
        return "down" if self.desired < self.current else "none"


@dataclass(frozen=True)
class RouterActivity:
    """What the router pods report, summed over them."""

    held: int  # requests waiting for a ready replica
    inflight: int  # requests the routers have in flight at replicas
    last_request: float | None  # unix seconds of the newest request at any router
    routers: int = 1  # router pods with fresh data


def _requests(n: int) -> str:
    return f"{n} request" if n == 1 else f"{n} requests"


def zero_decision(
    current: int, activity: RouterActivity, idle_after_s: float, now: float
) -> Decision | None:
    """Scale from and to zero (``minReplicas`` 0, behind the router); None: the usual
    decision applies, with at least one replica.

    At 0 replicas: 1 as soon as a router holds a request, else 0. Above 0: 0 once no router
    holds or has in flight a request and the newest request is ``idle_after_s`` old.
    """
    if current == 0:
        waiting = activity.held + activity.inflight
        if waiting:
            reason = f"{_requests(waiting)} held at the router, 0 replicas -> 1"
            return Decision(0, 1, reason, ROUTER, 1, None, None, 0, True)
        reason = "no request held at the router; keeping 0 replicas"
        return Decision(0, 0, reason, ROUTER, 0, None, None, 0, True)
    if activity.held or activity.inflight or activity.last_request is None:
        return None
    idle = now - activity.last_request
    if idle < idle_after_s:
        return None
    reason = (
        f"no request at the router for {idle:.0f}s (scaleToZeroAfterSeconds "
        f"{idle_after_s:g}), {_plural(current)} -> 0"
    )
    return Decision(current, 0, reason, ROUTER, 0, None, None, 0, True)


def _fresh(sample: PodSample, now: float, max_age: float) -> bool:
    return sample.timestamp is not None and now - sample.timestamp <= max_age


def _plural(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def _ceil(x: float) -> int:
    return math.ceil(x - _EPS)


def _label(name: str, value: float) -> str:
    return f"KV usage {value:.2f}" if name == KV else f"queue depth {value:.2f}"


def _target(name: str, target: float) -> str:
    return f"{target:.2f}" if name == KV else f"{target:g}"


def evaluate_signal(
    name: str, values: Sequence[float], replicas: int, target: float, tolerance: float, current: int
) -> Signal:
    """One signal's recommendation (HPA's ``calcPlainMetricReplicas`` for an average value).

    ``values`` come from the pods with data; ``replicas - len(values)`` replicas have none.
    """
    if not values:
        return Signal(name, None, target, None, f"no {name.replace('_', ' ')} data")
    measured = len(values)
    total = sum(values)
    average = total / measured
    ratio = average / target
    missing = max(0, replicas - measured)
    count = measured + missing
    if missing:
        # Missing pods never look idle: at target when the rest ask for fewer replicas,
        # at 0 when they ask for more (the increase is not overstated).
        total += missing * target if ratio < 1 else 0.0
        new_ratio = total / count / target
        flipped = (ratio < 1) != (new_ratio < 1)
        how = "at target" if ratio < 1 else "as 0"
        where = f"on {measured} of {_plural(count)} ({missing} without metrics, counted {how})"
    else:
        new_ratio, flipped, where = ratio, False, f"on {_plural(count)}"
    label, tgt = _label(name, average), _target(name, target)
    if abs(ratio - 1) <= tolerance:
        text = f"avg {label} within {tolerance * 100:g}% of target {tgt} {where}"
        return Signal(name, average, target, current, text)
    text = f"avg {label} {'>' if ratio > 1 else '<'} target {tgt} {where}"
    if abs(new_ratio - 1) <= tolerance or flipped:
        return Signal(name, average, target, current, text)
    return Signal(name, average, target, _ceil(new_ratio * count), text)


def _no_change(
    current: int, reason: str, kv: float | None, queue: float | None, measured: int, ok: bool
) -> Decision:
    return Decision(current, current, reason, None, None, kv, queue, measured, ok)


def stabilize(
    policy: Policy, current: int, raw: int, history: History, now: float
) -> tuple[int, History]:
    """HPA's ``stabilizeRecommendationWithBehaviors``: record ``raw``, return the count the
    windows allow and the pruned history (with ``raw`` appended)."""
    keep = max(policy.scale_up_window_s, policy.scale_down_window_s)
    kept = tuple(r for r in history if now - r.timestamp <= keep)
    if not kept:
        kept = (Recommendation(now, current),)  # a fresh history: no scale-down for a window
    up, down = raw, raw
    for rec in kept:
        if now - rec.timestamp < policy.scale_up_window_s:
            up = min(up, rec.replicas)
        if now - rec.timestamp < policy.scale_down_window_s:
            down = max(down, rec.replicas)
    stabilized = min(max(current, up), down)
    return stabilized, (*kept, Recommendation(now, raw))


def decide(
    policy: Policy,
    current_replicas: int,
    samples: Sequence[PodSample],
    history: History,
    now: float,
) -> tuple[Decision, History]:
    """One evaluation; returns the decision and the history to pass next time."""
    current = current_replicas
    lo, hi = policy.min_replicas, policy.max_replicas
    fresh = [s for s in samples if _fresh(s, now, policy.max_sample_age_s)]
    kv_values = [s.kv_usage for s in fresh if s.kv_usage is not None]
    queue_values = [s.queue_depth for s in fresh if s.queue_depth is not None]
    kv_avg = sum(kv_values) / len(kv_values) if kv_values else None
    queue_avg = sum(queue_values) / len(queue_values) if queue_values else None
    measured = len({s.pod for s in fresh if s.kv_usage is not None or s.queue_depth is not None})
    if not lo <= current <= hi:
        bound, name = (hi, "maxReplicas") if current > hi else (lo, "minReplicas")
        side = "above" if current > hi else "below"
        reason = f"{_plural(current)} {side} {name} {bound} -> {bound}"
        return Decision(current, bound, reason, None, None, kv_avg, queue_avg, measured, True), (
            history
        )
    if not fresh:
        stale = len(samples) - len(fresh)
        why = f" ({stale} stale)" if stale else ""
        reason = f"no fresh metrics from any of {_plural(current)}{why}; keeping {current}"
        return _no_change(current, reason, None, None, 0, False), history

    replicas = max(current, measured)
    signals = [
        evaluate_signal(KV, kv_values, replicas, policy.target_kv_usage, policy.tolerance, current),
        evaluate_signal(
            QUEUE, queue_values, replicas, policy.target_queue_depth, policy.tolerance, current
        ),
    ]
    valid = [s for s in signals if s.replicas is not None]
    if not valid:
        reason = f"no KV-cache or queue metrics from {_plural(current)}; keeping {current}"
        return _no_change(current, reason, kv_avg, queue_avg, measured, False), history
    best = max(valid, key=lambda s: s.replicas or 0)  # ties: the first (KV) wins
    raw = best.replicas
    assert raw is not None
    notes = []
    if len(valid) < len(signals) and raw < current:
        missing = next(s.name for s in signals if s.replicas is None)
        notes.append(f"no scale-down without {missing.replace('_', ' ')} data")
        raw = current

    stabilized, new_history = stabilize(policy, current, raw, history, now)
    # Only holds that change the outcome are worth a note (not those the clamps undo).
    if stabilized > max(raw, lo):
        notes.append(
            f"held at {stabilized} by the highest recommendation of the last "
            f"{policy.scale_down_window_s:g}s"
        )
    elif stabilized < min(raw, hi) and stabilized != current:
        notes.append(
            f"held at {stabilized} by the lowest recommendation of the last "
            f"{policy.scale_up_window_s:g}s"
        )
    elif stabilized < min(raw, hi):
        notes.append(f"waiting {policy.scale_up_window_s:g}s scale-up stabilization")
    desired = stabilized
    if desired > current:
        limit = max(current + 1, _ceil(current * (1 + policy.scale_up_limit_percent / 100)))
        if desired > limit:
            notes.append(
                f"limited from {desired}: at most +{policy.scale_up_limit_percent}% per period"
            )
            desired = limit
    if desired > hi:
        notes.append(f"capped at maxReplicas {hi}")
        desired = hi
    if desired < lo:
        notes.append(f"raised to minReplicas {lo}")
        desired = lo
    suffix = f" ({'; '.join(notes)})" if notes else ""
    reason = f"{best.text} -> {desired}{suffix}"
    decision = Decision(current, desired, reason, best.name, raw, kv_avg, queue_avg, measured, True)
    return decision, new_history
