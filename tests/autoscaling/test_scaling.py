"""The autoscaler's decision function, table-driven: pure, no I/O, no clock."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from typing import Any

import pytest

from kvscale.operator.scaling import (
    KV,
    QUEUE,
    ROUTER,
    History,
    PodSample,
    Policy,
    Recommendation,
    RouterActivity,
    decide,
    zero_decision,
)
from tests.autoscaling.timeline import direction_changes

NOW = 1_000_000.0
POLICY = Policy(
    min_replicas=1,
    max_replicas=4,
    target_kv_usage=0.70,
    target_queue_depth=2.0,
    tolerance=0.10,
    scale_up_limit_percent=100,
    scale_up_window_s=0.0,
    scale_down_window_s=300.0,
    max_sample_age_s=45.0,
)


def pods(
    kv: Sequence[float | None], queue: Sequence[float | None] | None = None, age: float = 1.0
) -> list[PodSample]:
    """Ready pods ``p0, p1, ...`` with these readings, scraped ``age`` seconds ago."""
    queue = [0.0] * len(kv) if queue is None else queue
    return [
        PodSample(f"p{i}", k, q, NOW - age) for i, (k, q) in enumerate(zip(kv, queue, strict=True))
    ]


def past(*recs: tuple[float, int]) -> History:
    """History entries ``(seconds ago, replicas)``."""
    return tuple(Recommendation(NOW - ago, n) for ago, n in recs)


QUIET = past((299, 1))  # a quiet past inside the window (an empty history is "fresh")

CASES: list[dict[str, Any]] = [
    # --- step changes up --------------------------------------------------------------------
    dict(
        id="kv-step-up",
        current=2,
        samples=pods([0.91, 0.91]),
        history=QUIET,
        desired=3,
        signal=KV,
        reason="avg KV usage 0.91 > target 0.70 on 2 replicas -> 3",
    ),
    dict(
        id="queue-step-up-limited-to-doubling",
        current=1,
        samples=pods([0.30], [5.0]),
        history=QUIET,
        desired=2,
        signal=QUEUE,
        reason="avg queue depth 5.00 > target 2 on 1 replica -> 2 "
        "(limited from 3: at most +100% per period)",
    ),
    dict(
        id="largest-signal-wins",
        current=2,
        samples=pods([0.91, 0.91], [6.0, 6.0]),  # KV asks for 3, queue for 6 (limited to 4)
        history=QUIET,
        desired=4,
        signal=QUEUE,
        reason="avg queue depth 6.00 > target 2 on 2 replicas -> 4 "
        "(limited from 6: at most +100% per period)",
    ),
    dict(
        id="custom-rate-limit",
        policy=dict(scale_up_limit_percent=50, max_replicas=20),
        current=4,
        samples=pods([1.0] * 4, [8.0] * 4),
        history=QUIET,
        desired=6,
        reason=r"-> 6 \(limited from 16: at most \+50% per period\)$",
    ),
    dict(
        id="rate-limit-at-least-one-pod",
        policy=dict(scale_up_limit_percent=10),
        current=2,
        samples=pods([1.0, 1.0]),
        history=QUIET,
        desired=3,
        reason=r"limited from 3|-> 3$",
    ),
    # --- tolerance --------------------------------------------------------------------------
    dict(
        id="within-tolerance-above",
        current=2,
        samples=pods([0.76, 0.76]),  # ratio 1.086
        history=QUIET,
        desired=2,
        reason="avg KV usage 0.76 within 10% of target 0.70 on 2 replicas -> 2",
    ),
    dict(
        id="within-tolerance-below",
        current=3,
        samples=pods([0.64, 0.64, 0.64]),  # ratio 0.914
        history=QUIET,
        desired=3,
        reason="within 10% of target 0.70",
    ),
    dict(
        id="just-outside-tolerance",
        current=2,
        samples=pods([0.78, 0.78]),  # ratio 1.114
        history=QUIET,
        desired=3,
        reason="avg KV usage 0.78 > target 0.70 on 2 replicas -> 3",
    ),
    dict(
        id="zero-tolerance",
        policy=dict(tolerance=0.0),
        current=2,
        samples=pods([0.72, 0.72]),
        history=QUIET,
        desired=3,
    ),
    # --- step changes down and stabilization ------------------------------------------------
    dict(
        id="step-down-after-quiet-window",
        current=3,
        samples=pods([0.05, 0.05, 0.05]),
        history=past((400, 3), (290, 1), (100, 1)),
        desired=1,
        signal=KV,
        reason="avg KV usage 0.05 < target 0.70 on 3 replicas -> 1",
    ),
    dict(
        id="step-down-held-by-window",
        current=3,
        samples=pods([0.05, 0.05, 0.05]),
        history=past((400, 4), (200, 3), (30, 1)),
        desired=3,
        reason="-> 3 (held at 3 by the highest recommendation of the last 300s)",
    ),
    dict(
        id="step-down-partly-held",
        current=3,
        samples=pods([0.05, 0.05, 0.05]),
        history=past((400, 3), (200, 2), (30, 1)),
        desired=2,
        reason="held at 2 by the highest recommendation",
    ),
    dict(
        id="fresh-history-never-scales-down",
        current=3,
        samples=pods([0.0, 0.0, 0.0]),
        history=(),
        desired=3,
        reason="held at 3",
    ),
    dict(
        id="scale-up-window-waits",
        policy=dict(scale_up_window_s=60),
        current=1,
        samples=pods([1.0]),
        history=past((30, 1)),
        desired=1,
        reason="waiting 60s scale-up stabilization",
    ),
    dict(
        id="scale-up-window-lowest-wins",
        policy=dict(scale_up_window_s=60),
        current=1,
        samples=pods([1.0]),  # asks for 2
        history=past((50, 2), (30, 3)),
        desired=2,
    ),
    # --- clamps -----------------------------------------------------------------------------
    dict(
        id="capped-at-max",
        current=3,
        samples=pods([1.0, 1.0, 1.0]),
        history=QUIET,
        desired=4,
        reason="-> 4 (capped at maxReplicas 4)",
    ),
    dict(
        id="raised-to-min",
        policy=dict(min_replicas=2, scale_down_window_s=0),
        current=3,
        samples=pods([0.0, 0.0, 0.0]),
        history=(),
        desired=2,
        reason="-> 2 (raised to minReplicas 2)",
    ),
    dict(
        id="above-max-brought-back-without-metrics",
        current=6,
        samples=[],
        history=QUIET,
        desired=4,
        reason="6 replicas above maxReplicas 4 -> 4",
    ),
    dict(
        id="below-min-brought-back",
        policy=dict(min_replicas=2),
        current=1,
        samples=pods([0.0]),
        history=QUIET,
        desired=2,
        reason="1 replica below minReplicas 2 -> 2",
    ),
    # --- missing and stale data -------------------------------------------------------------
    dict(
        id="no-samples-no-change",
        current=2,
        samples=[],
        history=QUIET,
        desired=2,
        ok=False,
        reason="no fresh metrics from any of 2 replicas; keeping 2",
    ),
    dict(
        id="all-stale-no-change",
        current=2,
        samples=pods([0.0, 0.0], age=100),
        history=QUIET,
        desired=2,
        ok=False,
        reason="no fresh metrics from any of 2 replicas (2 stale); keeping 2",
    ),
    dict(
        id="scrape-failed-no-values",
        current=2,
        samples=[PodSample("p0", None, None, None), PodSample("p1", None, None, None)],
        history=QUIET,
        desired=2,
        ok=False,
    ),
    dict(
        id="missing-pods-count-at-target-for-scale-down",
        # 1 of 4 replicas measured at half the target; counted idle the others would give 1.
        current=4,
        samples=pods([0.35]),
        history=QUIET,
        desired=4,
        reason="avg KV usage 0.35 < target 0.70 on 1 of 4 replicas (3 without metrics, "
        "counted at target) -> 4",
    ),
    dict(
        id="stale-pod-is-missing-not-idle",
        current=3,
        samples=[*pods([0.0, 0.0]), PodSample("p2", 0.0, 0.0, NOW - 100)],
        history=QUIET,
        desired=1,  # two idle pods are enough to scale down; the stale one counts at target
        reason="on 2 of 3 replicas (1 without metrics, counted at target) -> 1",
    ),
    dict(
        id="missing-pods-count-as-zero-for-scale-up",
        current=2,
        samples=pods([0.95]),  # measured 1.36x target; with the missing one at 0: 0.68x
        history=QUIET,
        desired=2,
        reason="avg KV usage 0.95 > target 0.70 on 1 of 2 replicas (1 without metrics, "
        "counted as 0) -> 2",
    ),
    dict(
        id="missing-pods-scale-up-when-still-above",
        current=2,
        samples=pods([1.0], [9.0]),  # queue 4.5x target even with the missing pod at 0
        history=QUIET,
        desired=4,
        signal=QUEUE,
    ),
    dict(
        id="one-signal-missing-blocks-scale-down",
        current=3,
        samples=pods([0.0, 0.0, 0.0], [None, None, None]),
        history=QUIET,
        desired=3,
        reason="(no scale-down without queue depth data)",
    ),
    dict(
        id="one-signal-missing-allows-scale-up",
        current=2,
        samples=pods([1.0, 1.0], [None, None]),
        history=QUIET,
        desired=3,
        signal=KV,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_decision_table(case: dict[str, Any]) -> None:
    policy = dataclasses.replace(POLICY, **case.get("policy", {}))
    decision, history = decide(policy, case["current"], case["samples"], case["history"], NOW)
    assert decision.desired == case["desired"], decision.reason
    assert decision.current == case["current"]
    assert decision.metrics_ok is case.get("ok", True), decision.reason
    if "signal" in case:
        assert decision.signal == case["signal"]
    if "reason" in case:
        want = case["reason"]
        if any(ch in want for ch in "$|\\"):
            assert re.search(want, decision.reason), decision.reason
        else:
            assert want in decision.reason, decision.reason
    assert decision.direction == (
        "up"
        if case["desired"] > case["current"]
        else "down"
        if case["desired"] < case["current"]
        else "none"
    )
    if decision.metrics_ok and decision.recommendation is not None:
        # The raw recommendation is recorded; nothing older than both windows is kept.
        assert history[-1] == Recommendation(NOW, decision.recommendation)
        assert all(NOW - r.timestamp <= 300 for r in history)
    else:
        assert history == case["history"]  # failed evaluations record nothing


def test_reports_per_replica_averages() -> None:
    decision, _ = decide(POLICY, 2, pods([0.5, 0.9], [1.0, 4.0]), QUIET, NOW)
    assert decision.kv_usage == pytest.approx(0.7)
    assert decision.queue_depth == pytest.approx(2.5)
    assert decision.measured == 2


def test_history_is_seeded_with_the_current_count() -> None:
    _, history = decide(POLICY, 3, pods([0.0, 0.0, 0.0]), (), NOW)
    assert history == (Recommendation(NOW, 3), Recommendation(NOW, 0))  # raw, before clamps


# --- simulations: the decision in a loop against a synthetic load -----------------------------

INTERVAL = 15.0


def simulate(
    policy: Policy, demand: Sequence[float], noise: float = 0.0, seed: int = 0, start: int = 1
) -> list[int]:
    """Replicas after each evaluation when the total KV demand (sum of per-replica fractions)
    is ``demand[i]`` at evaluation ``i``; each replica reads demand/n plus uniform noise."""
    rng = random.Random(seed)
    replicas, history, out = start, (), []
    for i, total in enumerate(demand):
        now = NOW + i * INTERVAL
        per = [min(1.0, max(0.0, total / replicas + rng.uniform(-noise, noise)))] * replicas
        samples = [PodSample(f"p{j}", per[j], 0.0, now - 1) for j in range(replicas)]
        decision, history = decide(policy, replicas, samples, history, now)
        replicas = decision.desired
        out.append(replicas)
    return out


def test_step_load_up_then_down() -> None:
    # 20 quiet evaluations, 40 loaded (demand of 2.5 replicas at 100%), 60 quiet again.
    demand = [0.1] * 20 + [2.5] * 40 + [0.1] * 60
    series = simulate(POLICY, demand)
    up_at = next(i for i, n in enumerate(series) if n > 1)
    assert up_at == 20  # the first loaded evaluation scales up (1 -> 2, the doubling limit)
    # KV usage saturates at 1.0 per replica, so it takes two more evaluations to reach 4.
    assert series[20:23] == [2, 3, 4] and max(series) == 4
    assert min(series[22:60]) == 4  # no scale-down while loaded
    down_at = next(i for i in range(60, len(series)) if series[i] < 4)
    last_high = 59  # the last loaded evaluation
    assert (down_at - last_high) * INTERVAL == POLICY.scale_down_window_s  # a window later
    assert series[down_at] == 1 and series[-1] == 1 and direction_changes(series) == 1


def test_noisy_signal_does_not_flap() -> None:
    # A steady demand near a replica boundary with +-0.15 noise on every reading.
    demand = [1.6] * 240  # one hour
    stable = simulate(POLICY, demand, noise=0.15, seed=7)
    assert direction_changes(stable) == 0 and stable[-1] == stable[20] == 3
    # The same signal without the scale-down window flaps: the window is what prevents it.
    flappy = simulate(dataclasses.replace(POLICY, scale_down_window_s=0), demand, 0.15, 7)
    assert direction_changes(flappy) >= 5


@pytest.mark.parametrize("seed", range(5))
def test_noisy_step_load_moves_once_each_way(seed: int) -> None:
    demand = [0.2] * 30 + [2.0] * 80 + [0.2] * 60
    series = simulate(POLICY, demand, noise=0.1, seed=seed)
    assert direction_changes(series) <= 1
    assert series[-1] == 1 and max(series) >= 3


# --- scale from and to zero (minReplicas 0, behind the router) ---------------------------


def test_from_zero_on_a_held_request() -> None:
    busy = RouterActivity(held=1, inflight=0, last_request=NOW)
    d = zero_decision(0, busy, 300, NOW)
    assert d is not None and (d.current, d.desired) == (0, 1) and d.signal == ROUTER
    assert d.reason == "1 request held at the router, 0 replicas -> 1"
    three = zero_decision(0, RouterActivity(held=3, inflight=0, last_request=NOW), 300, NOW)
    assert three is not None and three.desired == 1 and three.reason.startswith("3 requests")


def test_stays_at_zero_without_requests() -> None:
    quiet = RouterActivity(held=0, inflight=0, last_request=NOW - 5000)
    d = zero_decision(0, quiet, 300, NOW)
    assert d is not None and d.desired == 0 and d.metrics_ok


@pytest.mark.parametrize(
    ("activity", "zero"),
    [
        (RouterActivity(0, 0, NOW - 301), True),  # quiet for the whole window
        (RouterActivity(0, 0, NOW - 299), False),  # not yet
        (RouterActivity(1, 0, NOW - 999), False),  # one held (a replica restarting)
        (RouterActivity(0, 2, NOW - 999), False),  # long requests still streaming
        (RouterActivity(0, 0, None), False),  # no request time: never guess
    ],
)
def test_to_zero_after_the_quiet_window(activity: RouterActivity, zero: bool) -> None:
    d = zero_decision(2, activity, 300, NOW)
    if not zero:
        assert d is None  # the usual decision, with at least one replica
        return
    assert d is not None and (d.current, d.desired) == (2, 0)
    assert d.reason == (
        "no request at the router for 301s (scaleToZeroAfterSeconds 300), 2 replicas -> 0"
    )


def test_the_usual_decision_never_goes_below_one() -> None:
    policy = dataclasses.replace(POLICY, min_replicas=1)  # policy_for(minReplicas 0)
    d, _ = decide(policy, 1, pods([0.0], [0.0]), (), NOW)
    assert d.desired == 1
