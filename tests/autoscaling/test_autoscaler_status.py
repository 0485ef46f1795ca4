"""The autoscaler's pure pieces: spec -> policy, the status it writes, operator settings."""

from __future__ import annotations

from typing import Any

import pytest

from kvscale.operator import constants as c
from kvscale.operator.autoscaler import (
    interval_for,
    lease_duration,
    policy_for,
    status_update,
)
from kvscale.operator.config import OperatorConfig
from kvscale.operator.scaling import Decision, Policy
from kvscale.operator.spec import SpecError, parse_spec

NOW = "2026-01-01T00:00:00Z"
SOURCE = {"source": "builtin://demo"}


def _auto(**fields: Any) -> Any:
    return parse_spec({"model": SOURCE, "autoscaling": {"enabled": True, **fields}}).autoscaling


def test_policy_from_the_spec() -> None:
    auto = _auto(
        minReplicas=2,
        maxReplicas=6,
        targetKVCacheUtilizationPercent=70,
        targetQueueDepthPerReplica=4,
        tolerancePercent=5,
        scaleUpLimitPercent=50,
        scaleDownStabilizationWindowSeconds=120,
        intervalSeconds=10,
    )
    interval = interval_for(auto, OperatorConfig())
    assert interval == 10.0
    assert policy_for(auto, interval) == Policy(
        min_replicas=2,
        max_replicas=6,
        target_kv_usage=0.70,
        target_queue_depth=4.0,
        tolerance=0.05,
        scale_up_limit_percent=50,
        scale_up_window_s=0.0,
        scale_down_window_s=120.0,
        max_sample_age_s=30.0,  # three intervals unless maxMetricAgeSeconds says otherwise
    )
    assert policy_for(_auto(maxMetricAgeSeconds=7), 10).max_sample_age_s == 7.0


def test_defaults_follow_the_hpa_and_the_operator() -> None:
    auto = _auto()
    assert auto.scale_up_stabilization_window_seconds == 0  # HPA: scale up at once
    assert auto.scale_down_stabilization_window_seconds == 300  # HPA: 5 minutes
    assert auto.tolerance_percent == 10 and auto.scale_up_limit_percent == 100
    assert interval_for(auto, OperatorConfig()) == 15.0
    assert interval_for(auto, OperatorConfig(autoscale_interval_seconds=30)) == 30.0
    assert lease_duration(15) == 45 and lease_duration(1) == 15


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"intervalSeconds": 0}, "spec.autoscaling.intervalSeconds: must be between 1 and 3600"),
        ({"tolerancePercent": 101}, "spec.autoscaling.tolerancePercent"),
        ({"scaleUpLimitPercent": 0}, "spec.autoscaling.scaleUpLimitPercent"),
        ({"prometheusUrl": "prometheus:9090"}, "must be an http(s) URL"),
    ],
)
def test_bad_autoscaling_fields_name_the_field(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _auto(**fields)


def _decision(current: int, desired: int, ok: bool = True, reason: str = "why") -> Decision:
    kv, queue = (0.91, 1.234) if ok else (None, None)
    return Decision(current, desired, reason, "kv_cache", desired, kv, queue, current, ok)


OLD_CONDITIONS = [
    {"type": c.DEGRADED, "status": "False", "reason": "Healthy", "lastTransitionTime": "t0"},
    {"type": c.SCALING_ACTIVE, "status": "Unknown", "reason": "AwaitingMetrics"},
    {"type": c.READY, "status": "True", "reason": "AllReplicasReady", "lastTransitionTime": "t0"},
]


def test_status_when_scaling() -> None:
    reason = "avg KV usage 0.91 > target 0.70 on 2 replicas -> 3"
    patch = status_update(
        {"conditions": OLD_CONDITIONS}, _decision(2, 3, reason=reason), None, 4, NOW
    )
    assert patch["desiredReplicas"] == 3 and patch["lastScaleTime"] == NOW
    assert patch["lastScaleReason"] == reason
    assert patch["kvCacheUsagePercent"] == 91 and patch["queueDepthPerReplica"] == 1.23
    conds = patch["conditions"]
    assert [x["type"] for x in conds] == [c.DEGRADED, c.SCALING_ACTIVE, c.READY]  # order kept
    assert conds[0] == OLD_CONDITIONS[0] and conds[2] == OLD_CONDITIONS[2]
    active = conds[1]
    assert (active["status"], active["reason"], active["message"]) == (
        "True",
        "ValidMetricFound",
        reason,
    )
    assert active["observedGeneration"] == 4 and active["lastTransitionTime"] == NOW


def test_status_without_a_change_only_refreshes_what_moved() -> None:
    first = status_update({"conditions": OLD_CONDITIONS}, _decision(2, 2), None, 4, NOW)
    assert "lastScaleTime" not in first and "desiredReplicas" not in first
    status = {"conditions": OLD_CONDITIONS, **first}
    assert status_update(status, _decision(2, 2), None, 4, "later") == {}  # nothing to write


def test_status_when_metrics_cannot_be_read() -> None:
    status = {"conditions": OLD_CONDITIONS, "kvCacheUsagePercent": 50, "queueDepthPerReplica": 1}
    decision = _decision(
        3, 3, ok=False, reason="cannot reach Prometheus at http://p:9090; keeping 3"
    )
    patch = status_update(status, decision, "PrometheusUnreachable", 4, NOW)
    assert patch["kvCacheUsagePercent"] is None and patch["queueDepthPerReplica"] is None  # removed
    assert "desiredReplicas" not in patch and "lastScaleTime" not in patch  # replicas stay
    active = next(x for x in patch["conditions"] if x["type"] == c.SCALING_ACTIVE)
    assert (active["status"], active["reason"]) == ("False", "PrometheusUnreachable")
    assert active["message"].endswith("keeping 3")


def test_operator_settings_from_the_environment() -> None:
    config = OperatorConfig.from_env(
        {
            "KVSCALE_PROMETHEUS_URL": "http://prometheus:9090",
            "KVSCALE_AUTOSCALE_INTERVAL_SECONDS": "20",
            "KVSCALE_METRICS_PORT": "8081",
            "POD_NAME": "kvscale-operator-abc",
        }
    )
    assert config.prometheus_url == "http://prometheus:9090"
    assert config.autoscale_interval_seconds == 20.0 and config.metrics_port == 8081
    assert config.identity == "kvscale-operator-abc"
    assert (
        OperatorConfig.from_env({"KVSCALE_OPERATOR_ID": "dev", "POD_NAME": "p"}).identity == "dev"
    )
    default = OperatorConfig.from_env({})
    assert default.metrics_port == 0 and default.prometheus_url is None
    assert default.identity  # hostname-pid
