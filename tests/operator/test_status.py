"""Status and conditions are computed purely from the Deployment and its pods."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscale.operator import constants as c
from kvscale.operator.spec import parse_spec
from kvscale.operator.status import (
    Problem,
    compute_status,
    deployment_problems,
    merge_conditions,
    pod_problems,
    status_patch,
)

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def _conds(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {cond["type"]: cond for cond in status["conditions"]}


def _deployment(ready: int, updated: int | None = None, generation: int = 1, observed: int = 1):
    updated = ready if updated is None else updated
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": max(ready, updated),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def _status(
    llmd: dict[str, Any],
    deployment: dict[str, Any] | None,
    problems=(),
    desired: int = 2,
    now: str = NOW,
):
    spec = parse_spec(llmd["spec"])
    return compute_status(
        llmd,
        spec,
        deployment,
        list(problems),
        desired=desired,
        selector="s",
        endpoint="http://e",
        now=now,
    )


def test_rollout_then_ready(make_llmd: Callable[..., dict[str, Any]]) -> None:
    llmd = make_llmd({"model": {"source": "hf://a/b"}, "replicas": 2})
    status = _status(llmd, _deployment(ready=0, updated=0))
    conds = _conds(status)
    assert conds[c.READY]["status"] == "False" and conds[c.READY]["reason"] == "ReplicasNotReady"
    assert (
        conds[c.PROGRESSING]["status"] == "True"
        and "0/2 replicas updated" in conds[c.PROGRESSING]["message"]
    )
    assert conds[c.DEGRADED]["status"] == "False"
    assert conds[c.SCALING_ACTIVE]["reason"] == "AutoscalingDisabled"
    assert status["desiredReplicas"] == 2 and status["observedGeneration"] == 1
    llmd["status"] = status
    ready = _status(llmd, _deployment(ready=2), now=LATER)
    conds = _conds(ready)
    assert conds[c.READY]["status"] == "True" and conds[c.READY]["lastTransitionTime"] == LATER
    assert "2/2 replicas ready at http://e" in conds[c.READY]["message"]
    assert conds[c.PROGRESSING]["reason"] == "RolloutComplete"
    assert conds[c.DEGRADED]["lastTransitionTime"] == NOW  # unchanged status keeps its time
    assert ready["readyReplicas"] == 2


def test_stale_deployment_generation_is_still_progressing(
    make_llmd: Callable[..., dict[str, Any]],
) -> None:
    llmd = make_llmd({"model": {"source": "hf://a/b"}, "replicas": 2})
    conds = _conds(_status(llmd, _deployment(ready=2, generation=2, observed=1)))
    assert conds[c.PROGRESSING]["status"] == "True" and conds[c.READY]["status"] == "False"


def test_problems_make_it_degraded(make_llmd: Callable[..., dict[str, Any]]) -> None:
    llmd = make_llmd({"model": {"source": "hf://a/b"}})
    problems = [Problem("SecretNotFound", "Secret ml/hf does not exist"), Problem("X", "also this")]
    conds = _conds(_status(llmd, None, problems, desired=1))
    assert conds[c.DEGRADED]["status"] == "True" and conds[c.DEGRADED]["reason"] == "SecretNotFound"
    assert conds[c.DEGRADED]["message"] == "Secret ml/hf does not exist; also this"
    assert conds[c.READY]["reason"] == "SecretNotFound"
    assert conds[c.PROGRESSING]["reason"] == "NotCreated"


def test_unschedulable_and_crashing_pods(make_llmd: Callable[..., dict[str, Any]]) -> None:
    spec = parse_spec(
        {
            "model": {"source": "hf://a/b"},
            "engine": {"tensorParallelSize": 8},
            "resources": {"gpuType": "NVIDIA-H100"},
        }
    )
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
    }
    pods = [
        {"metadata": {"name": "p1"}, "status": {"conditions": [unschedulable]}},
        {"metadata": {"name": "p2"}, "status": {"conditions": [unschedulable]}},
        {
            "metadata": {"name": "p3"},
            "status": {
                "containerStatuses": [
                    {
                        "name": "server",
                        "state": {
                            "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m"}
                        },
                    }
                ]
            },
        },
        {
            "metadata": {"name": "p4", "deletionTimestamp": NOW},
            "status": {"conditions": [unschedulable]},
        },
        {
            "metadata": {"name": "p5"},
            "status": {
                "containerStatuses": [
                    {"name": "server", "state": {"waiting": {"reason": "ContainerCreating"}}}
                ]
            },
        },
    ]
    problems = {p.reason: p.message for p in pod_problems(pods, spec)}
    assert set(problems) == {"Unschedulable", "CrashLoopBackOff"}
    msg = problems["Unschedulable"]
    assert (
        "pod p1 cannot be scheduled: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." in msg
    )
    assert "8 nvidia.com/gpu on nodes labelled nvidia.com/gpu.product=NVIDIA-H100" in msg
    assert "tensorParallelSize" in msg and msg.endswith("(and 1 more pod)")
    assert "kubectl logs p3 -c server --previous" in problems["CrashLoopBackOff"]


def test_stuck_rollout() -> None:
    deployment = {
        "status": {
            "conditions": [
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": "ReplicaSet has timed out progressing.",
                }
            ]
        }
    }
    (problem,) = deployment_problems(deployment)
    assert problem.reason == "ProgressDeadlineExceeded" and "timed out" in problem.message


def test_autoscaler_owns_its_condition(make_llmd: Callable[..., dict[str, Any]]) -> None:
    llmd = make_llmd({"model": {"source": "hf://a/b"}, "autoscaling": {"enabled": True}})
    conds = _conds(_status(llmd, _deployment(ready=1), desired=1))
    assert (
        conds[c.SCALING_ACTIVE]["status"] == "Unknown"
        and conds[c.SCALING_ACTIVE]["reason"] == "AwaitingMetrics"
    )
    theirs = {
        "type": c.SCALING_ACTIVE,
        "status": "True",
        "reason": "ScaledUp",
        "message": "KV 91% > 80%",
        "lastTransitionTime": NOW,
    }
    llmd["status"] = {"conditions": [theirs], "lastScaleTime": NOW, "kvCacheUsagePercent": 91}
    status = _status(llmd, _deployment(ready=1), desired=1, now=LATER)
    assert _conds(status)[c.SCALING_ACTIVE] == theirs
    assert (
        "kvCacheUsagePercent" not in status and "lastScaleTime" not in status
    )  # never overwritten


def test_status_patch_is_none_when_nothing_changed(
    make_llmd: Callable[..., dict[str, Any]],
) -> None:
    llmd = make_llmd({"model": {"source": "hf://a/b"}})
    status = _status(llmd, _deployment(ready=1), desired=1)
    assert status_patch(None, status) == status
    llmd["status"] = {**status, "kvCacheUsagePercent": 40}
    assert (
        status_patch(llmd["status"], _status(llmd, _deployment(ready=1), desired=1, now=LATER))
        is None
    )


def test_merge_conditions_keeps_transition_times() -> None:
    old = [{"type": "Ready", "status": "True", "lastTransitionTime": NOW}]
    same = merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "R"}], LATER)
    flipped = merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "R"}], LATER)
    assert same[0]["lastTransitionTime"] == NOW and flipped[0]["lastTransitionTime"] == LATER
