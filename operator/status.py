"""Pure functions: observed Deployment and pods -> the LLMDeployment's ``status``.

Conditions follow the Kubernetes API conventions: ``type``, ``status`` (True/False/Unknown),
a CamelCase ``reason``, a ``message`` a person can act on, ``lastTransitionTime`` (kept while
the status stays the same) and ``observedGeneration``.

The operator owns the keys in :data:`OWNED_KEYS` and the Ready/Progressing/Degraded
conditions. The autoscaler (:mod:`kvscale.operator.autoscaler`) owns ``lastScaleTime``,
``lastScaleReason``, the observed metrics (``kvCacheUsagePercent``, ``queueDepthPerReplica``)
and, once it has evaluated, ``ScalingActive``; it also writes ``desiredReplicas``, which the
reconcile pass then follows (:func:`kvscale.operator.spec.desired_replicas`). The operator
only initialises ``ScalingActive`` and never overwrites the autoscaler's fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvscale.operator import constants as c
from kvscale.operator.spec import LLMDeploymentSpec

OWNED_KEYS = (
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "updatedReplicas",
    "availableReplicas",
    "desiredReplicas",
    "selector",
    "endpoint",
    "servedModelName",
    "conditions",
)
AUTOSCALER_KEYS = (
    "lastScaleTime",
    "lastScaleReason",
    "kvCacheUsagePercent",
    "queueDepthPerReplica",
)

# Container waiting reasons that will not fix themselves.
STUCK_REASONS = {
    "CrashLoopBackOff": "it keeps crashing; see `kubectl logs {pod} -c {ctr} --previous`",
    "ImagePullBackOff": "the image cannot be pulled; check spec.image and spec.imagePullSecrets",
    "ErrImagePull": "the image cannot be pulled; check spec.image and spec.imagePullSecrets",
    "InvalidImageName": "spec.image is not a valid image reference",
    "CreateContainerConfigError": "the container config is invalid (often a missing Secret key)",
    "CreateContainerError": "the container could not be created",
}


@dataclass(frozen=True)
class Problem:
    """Something that keeps the LLMDeployment from serving; becomes ``Degraded=True``."""

    reason: str
    message: str


def condition(
    type_: str, status: bool | None, reason: str, message: str, generation: int | None
) -> dict[str, Any]:
    value = "Unknown" if status is None else ("True" if status else "False")
    cond: dict[str, Any] = {"type": type_, "status": value, "reason": reason, "message": message}
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None, new: Iterable[Mapping[str, Any]], now: str
) -> list[dict[str, Any]]:
    """New conditions, keeping ``lastTransitionTime`` where the status did not change."""
    previous = {cond.get("type"): cond for cond in old or ()}
    merged = []
    for cond in new:
        out = dict(cond)
        before = previous.get(cond["type"])
        if before is not None and before.get("status") == cond["status"]:
            out["lastTransitionTime"] = before.get("lastTransitionTime", now)
        else:
            out["lastTransitionTime"] = now
        merged.append(out)
    return merged


def set_condition(
    old: Sequence[Mapping[str, Any]] | None, cond: Mapping[str, Any], now: str
) -> list[dict[str, Any]]:
    """``old`` with the condition of ``cond``'s type replaced (or appended), keeping the
    others and their order untouched."""
    before = [dict(x) for x in old or ()]
    (merged,) = merge_conditions([x for x in before if x.get("type") == cond["type"]], [cond], now)
    out = [merged if x.get("type") == cond["type"] else x for x in before]
    return out if any(x.get("type") == cond["type"] for x in before) else [*out, merged]


def pod_problems(pods: Iterable[Mapping[str, Any]], spec: LLMDeploymentSpec) -> list[Problem]:
    """Pods that cannot be scheduled or whose containers are stuck, one problem per reason."""
    found: dict[str, Problem] = {}
    counts: dict[str, int] = {}
    for pod in pods:
        name = pod.get("metadata", {}).get("name", "?")
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        for cond in status.get("conditions") or ():
            if (
                cond.get("type") == "PodScheduled"
                and cond.get("status") == "False"
                and cond.get("reason") == "Unschedulable"
            ):
                counts["Unschedulable"] = counts.get("Unschedulable", 0) + 1
                found.setdefault(
                    "Unschedulable", Problem("Unschedulable", _unschedulable(name, cond, spec))
                )
        for ctr in [
            *(status.get("initContainerStatuses") or ()),
            *(status.get("containerStatuses") or ()),
        ]:
            waiting = (ctr.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in STUCK_REASONS:
                counts[reason] = counts.get(reason, 0) + 1
                hint = STUCK_REASONS[reason].format(pod=name, ctr=ctr.get("name", "?"))
                detail = f": {waiting['message']}" if waiting.get("message") else ""
                found.setdefault(
                    reason,
                    Problem(
                        reason,
                        f"container {ctr.get('name')} of pod {name} is {reason}{detail} ({hint})",
                    ),
                )
    out = []
    for reason, problem in found.items():
        more = counts[reason] - 1
        suffix = f" (and {more} more pod{'s' if more > 1 else ''})" if more > 0 else ""
        out.append(Problem(problem.reason, problem.message + suffix))
    return out


def _unschedulable(pod: str, cond: Mapping[str, Any], spec: LLMDeploymentSpec) -> str:
    gpus = spec.gpus_per_replica
    need = f"{gpus} {c.GPU_RESOURCE}" if gpus else "no GPU"
    if spec.resources.gpu_type:
        need += f" on nodes labelled {c.GPU_PRODUCT_LABEL}={spec.resources.gpu_type}"
    sched = cond.get("message") or "no node fits"
    return (
        f"pod {pod} cannot be scheduled: {sched}. Each replica needs {need} "
        "(spec.engine.tensorParallelSize GPUs on one node); add GPU nodes, lower "
        "tensorParallelSize or replicas, or fix spec.resources.gpuType/nodeSelector/tolerations"
    )


def deployment_problems(deployment: Mapping[str, Any] | None) -> list[Problem]:
    out = []
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            out.append(
                Problem(
                    "ProgressDeadlineExceeded", f"the rollout is stuck: {cond.get('message', '')}"
                )
            )
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            out.append(
                Problem("ReplicaFailure", f"pods cannot be created: {cond.get('message', '')}")
            )
    return out


def _scaling_condition(
    spec: LLMDeploymentSpec, old: Sequence[Mapping[str, Any]] | None, generation: int | None
) -> dict[str, Any]:
    if not spec.autoscaling.enabled:
        return condition(
            c.SCALING_ACTIVE,
            False,
            "AutoscalingDisabled",
            "spec.autoscaling.enabled is false; replicas follow spec.replicas",
            generation,
        )
    for cond in old or ():
        if cond.get("type") == c.SCALING_ACTIVE and cond.get("reason") != "AutoscalingDisabled":
            return dict(cond)  # the autoscaler's own verdict
    return condition(
        c.SCALING_ACTIVE,
        None,
        "AwaitingMetrics",
        "the autoscaler has not evaluated KV-cache and queue metrics yet",
        generation,
    )


def compute_status(
    llmd: Mapping[str, Any],
    spec: LLMDeploymentSpec | None,
    deployment: Mapping[str, Any] | None,
    problems: Sequence[Problem],
    *,
    desired: int,
    selector: str,
    endpoint: str | None,
    now: str,
) -> dict[str, Any]:
    """The owned part of ``status`` (see :data:`OWNED_KEYS`)."""
    gen = llmd.get("metadata", {}).get("generation")
    old_status = llmd.get("status") or {}
    old = old_status.get("conditions") or []
    dstat = (deployment or {}).get("status") or {}
    ready = int(dstat.get("readyReplicas") or 0)
    available = int(dstat.get("availableReplicas") or 0)
    updated = int(dstat.get("updatedReplicas") or 0)
    total = int(dstat.get("replicas") or 0)
    dep_gen = (deployment or {}).get("metadata", {}).get("generation")
    observed = dstat.get("observedGeneration")
    rolled = deployment is not None and (dep_gen is None or observed == dep_gen)

    conds = []
    if problems:
        first = problems[0]
        more = "; ".join(p.message for p in problems[1:])
        conds.append(
            condition(
                c.DEGRADED, True, first.reason, first.message + (f"; {more}" if more else ""), gen
            )
        )
    else:
        conds.append(condition(c.DEGRADED, False, "Healthy", "no problems found", gen))

    if deployment is None:
        conds.append(
            condition(c.PROGRESSING, False, "NotCreated", "the Deployment is not created yet", gen)
        )
    elif not rolled or updated < desired or total > desired or available < desired:
        msg = (
            f"{updated}/{desired} replicas updated, {ready} ready, {available} available; "
            "model downloads and loads can take minutes"
        )
        conds.append(condition(c.PROGRESSING, True, "RollingOut", msg, gen))
    else:
        conds.append(
            condition(
                c.PROGRESSING, False, "RolloutComplete", f"{desired} replicas up to date", gen
            )
        )

    if desired == 0:
        conds.append(condition(c.READY, False, "ScaledToZero", "desired replicas is 0", gen))
    elif deployment is not None and rolled and available >= desired:
        conds.append(
            condition(
                c.READY,
                True,
                "AllReplicasReady",
                f"{available}/{desired} replicas ready at {endpoint}",
                gen,
            )
        )
    elif problems:
        conds.append(
            condition(
                c.READY,
                False,
                problems[0].reason,
                f"{ready}/{desired} replicas ready; see the Degraded condition",
                gen,
            )
        )
    else:
        conds.append(
            condition(c.READY, False, "ReplicasNotReady", f"{ready}/{desired} replicas ready", gen)
        )

    if spec is not None:
        conds.append(_scaling_condition(spec, old, gen))
    else:
        conds.extend(dict(cond) for cond in old if cond.get("type") == c.SCALING_ACTIVE)

    status: dict[str, Any] = {
        "observedGeneration": gen,
        "replicas": total,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "availableReplicas": available,
        "desiredReplicas": desired,
        "selector": selector,
        "endpoint": endpoint,
        "servedModelName": spec.model.served_model_name
        if spec
        else old_status.get("servedModelName"),
        "conditions": merge_conditions(old, conds, now),
    }
    return status


def status_patch(
    current: Mapping[str, Any] | None, owned: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The merge patch that brings ``current`` to ``owned``, or None when nothing changed."""
    current = current or {}
    changed = {k: v for k, v in owned.items() if current.get(k) != v}
    return changed or None
