"""Kopf handlers: thin wrappers around :func:`kvscale.operator.reconcile.reconcile`.

Run with ``kopf run -m kvscale.operator.handlers --all-namespaces --standalone``.

* LLMDeployment created, changed, or found at operator start (resume): full reconcile.
* An owned Deployment or pod changed (rollout progress, a pod unschedulable or crashing):
  reconcile the owner again, which refreshes its status and recreates what was deleted.
* Deletion needs no handler: every child carries an ownerReference, so Kubernetes'
  garbage collector removes them, and no finalizer can block the deletion.
* ``spec.autoscaling.enabled``: one asyncio task per LLMDeployment runs the autoscaler loop
  (:func:`kvscale.operator.autoscaler.run`), started and stopped from the LLMDeployment's
  watch events, so it also starts for every autoscaled object when the operator starts.
  Only the holder of the object's Lease acts. (Not a ``@kopf.daemon``: Kopf puts a finalizer
  on every object with a daemon, and a finalizer would block deleting an LLMDeployment while
  the operator is not running.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf
from kubernetes.aio.config import ConfigException

from kvscale.operator import autoscaler, telemetry
from kvscale.operator import constants as c
from kvscale.operator.config import OperatorConfig
from kvscale.operator.kube import USER_AGENT, KubeClient
from kvscale.operator.reconcile import LLMDEPLOYMENTS, Conflict, Outcome, reconcile
from kvscale.operator.status_writes import StatusWrites

LLMD = (c.GROUP, c.VERSION, c.PLURAL)
CHILD_LABELS = {c.MANAGED_BY_LABEL: c.MANAGER, c.OWNER_LABEL: kopf.PRESENT}
ROUTER_LABELS = {c.MANAGED_BY_LABEL: c.MANAGER, c.ROUTER_LABEL: kopf.PRESENT}


@kopf.on.startup()
async def startup(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Keep Kopf's bookkeeping in annotations (status belongs to the LLMDeployment's users)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # our own events are posted explicitly
    settings.posting.reporting_component = c.MANAGER
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    memo.config = OperatorConfig.from_env()
    agent = f"{USER_AGENT} ({memo.config.identity})"
    try:  # the official client: in-cluster token re-read as it rotates, or the kubeconfig
        memo.api = await KubeClient.connect(user_agent=agent)
    except ConfigException as e:
        raise kopf.PermanentError(f"no in-cluster service account and no kubeconfig: {e}") from e
    memo.http = aiohttp.ClientSession(headers={"User-Agent": agent})  # Prometheus and pods
    memo.locks = {}
    memo.status_writes = StatusWrites()
    memo.autoscalers = {}  # (namespace, name) -> (task, stop event)
    memo.metrics_server = None
    if memo.config.metrics_port:
        memo.metrics_server, _ = telemetry.serve(memo.config.metrics_port)
        logger.info("operator metrics on :%d/metrics", memo.config.metrics_port)
    logger.info(
        "kvscale operator %s: server image %s", memo.config.identity, memo.config.server_image
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await _stop_autoscalers(memo)  # each releases its Lease for a quick hand-over
    api = getattr(memo, "api", None)
    if api is not None:
        await api.close()
    http = getattr(memo, "http", None)
    if http is not None:
        await http.close()
    server = getattr(memo, "metrics_server", None)
    if server is not None:
        server.shutdown()


def _lock(memo: kopf.Memo, namespace: str, name: str) -> asyncio.Lock:
    return memo.locks.setdefault((namespace, name), asyncio.Lock())


def _post(body: Mapping[str, Any], outcome: Outcome) -> None:
    for type_, reason, message in outcome.events:
        kopf.event(body, type=type_, reason=reason, message=message)


# ---- indexes: what the watches saw, so that events need no reads (kopf keeps them) ------
def _by_owner(namespace: str, labels: Mapping[str, str], body: kopf.Body) -> dict[Any, Any]:
    return {(namespace, labels[c.OWNER_LABEL]): body}


@kopf.index(*LLMD)
def llmd_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): body}


@kopf.index("apps", "v1", "deployments", labels=CHILD_LABELS)
def deployment_index(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):  # type: ignore[no-untyped-def]
    return _by_owner(namespace, labels, body)


@kopf.index("apps", "v1", "deployments", labels=ROUTER_LABELS)
def router_index(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):  # type: ignore[no-untyped-def]
    return {(namespace, labels[c.ROUTER_LABEL]): body}


@kopf.index("v1", "services", labels=CHILD_LABELS)
def service_index(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):  # type: ignore[no-untyped-def]
    return _by_owner(namespace, labels, body)


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
def pdb_index(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):  # type: ignore[no-untyped-def]
    return _by_owner(namespace, labels, body)


@kopf.index("v1", "pods", labels=CHILD_LABELS)
def pod_index(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any):  # type: ignore[no-untyped-def]
    return _by_owner(namespace, labels, body)


def _one(index: kopf.Index[Any, Any], key: Any) -> dict[str, Any] | None:
    store = index.get(key)
    for value in store or ():
        return dict(value)
    return None


class IndexCache:
    """``reconcile``'s ChildCache over kopf's indexes."""

    def __init__(self, kw: Mapping[str, Any]) -> None:
        self._kinds = {
            "Deployment": kw["deployment_index"],
            "Service": kw["service_index"],
            "PodDisruptionBudget": kw["pdb_index"],
        }
        self._pods = kw["pod_index"]
        self._routers = kw["router_index"]

    def child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return _one(self._kinds[kind], (namespace, name))

    def pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [dict(p) for p in self._pods.get((namespace, name)) or ()]

    def router(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _one(self._routers, (namespace, name))


@kopf.on.resume(*LLMD)
@kopf.on.create(*LLMD)
@kopf.on.update(*LLMD)
async def reconcile_llmdeployment(
    body: kopf.Body, memo: kopf.Memo, namespace: str, name: str, **kw: Any
) -> None:
    """Create or update the Deployment, Service and PodDisruptionBudget; report status."""
    try:
        async with _lock(memo, namespace, name):
            llmd = await memo.status_writes.current(memo.api, namespace, name, body)
            if llmd is None:
                return
            outcome = await reconcile(memo.api, llmd, memo.config, cache=IndexCache(kw))
            memo.status_writes.wrote(namespace, name, outcome.status_version)
    except Conflict as e:
        raise kopf.TemporaryError(str(e), delay=1) from e
    _post(body, outcome)
    if outcome.invalid is not None:
        # Nothing to retry until the spec changes (which calls this handler again).
        raise kopf.PermanentError(f"invalid spec: {outcome.invalid}")
    if outcome.retry:
        reasons = "; ".join(p.message for p in outcome.problems)
        raise kopf.TemporaryError(reasons, delay=memo.config.retry_delay_seconds)


async def _reconcile_owner(
    memo: kopf.Memo, namespace: str, name: str, logger: logging.Logger, kw: Mapping[str, Any]
) -> None:
    async with _lock(memo, namespace, name):
        # The owner as last watched: a child's event needs no read of it (nor of the
        # children and pods: they come from the indexes too). Except when a child is gone:
        # the garbage collector may be removing it because its owner was just deleted,
        # which the owner's watch may not have seen yet: read the owner fresh then.
        if kw.get("type") == "DELETED":
            llmd = await memo.api.get(LLMDEPLOYMENTS.path(namespace, name))
        else:
            llmd = _one(kw["llmd_index"], (namespace, name))
            if llmd is not None:
                llmd = await memo.status_writes.current(memo.api, namespace, name, llmd)
        if llmd is None or llmd["metadata"].get("deletionTimestamp"):
            return
        try:
            outcome = await reconcile(memo.api, llmd, memo.config, cache=IndexCache(kw))
            memo.status_writes.wrote(namespace, name, outcome.status_version)
        except Conflict as e:
            logger.debug(
                "conflict while reconciling %s/%s: %s; the next event retries", namespace, name, e
            )
            return
    _post(llmd, outcome)


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def owned_deployment_changed(
    namespace: str, labels: Mapping[str, str], memo: kopf.Memo, logger: logging.Logger, **kw: Any
) -> None:
    """Rollout progress, replica counts, or a deleted Deployment: reconcile the owner."""
    await _reconcile_owner(memo, namespace, labels[c.OWNER_LABEL], logger, kw)


@kopf.on.event("apps", "v1", "deployments", labels=ROUTER_LABELS)
async def owned_router_changed(
    namespace: str, labels: Mapping[str, str], memo: kopf.Memo, logger: logging.Logger, **kw: Any
) -> None:
    """The router Deployment changed or was deleted: reconcile the owner."""
    await _reconcile_owner(memo, namespace, labels[c.ROUTER_LABEL], logger, kw)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=CHILD_LABELS)
async def owned_pdb_changed(
    namespace: str, labels: Mapping[str, str], memo: kopf.Memo, logger: logging.Logger, **kw: Any
) -> None:
    """A PDB that appeared or went: the owner decides whether it should exist."""
    await _reconcile_owner(memo, namespace, labels[c.OWNER_LABEL], logger, kw)


@kopf.on.event("v1", "pods", labels=CHILD_LABELS)
async def owned_pod_changed(
    namespace: str, labels: Mapping[str, str], memo: kopf.Memo, logger: logging.Logger, **kw: Any
) -> None:
    """Unschedulable or crashing pods surface as the owner's Degraded condition."""
    await _reconcile_owner(memo, namespace, labels[c.OWNER_LABEL], logger, kw)


@kopf.on.event(*LLMD)
async def llmdeployment_event(
    type: str | None,
    body: kopf.Body,
    spec: kopf.Spec,
    namespace: str,
    name: str,
    memo: kopf.Memo,
    logger: logging.Logger,
    **_: Any,
) -> None:
    """Run the autoscaler loop while ``spec.autoscaling.enabled``; forget per-object state
    once an LLMDeployment is gone (its children and its Lease are garbage-collected)."""
    gone = type == "DELETED" or bool(body.get("metadata", {}).get("deletionTimestamp"))
    _supervise(memo, namespace, name, not gone and _autoscaling_enabled(spec), logger)
    if type == "DELETED":
        memo.locks.pop((namespace, name), None)
        memo.status_writes.forget(namespace, name)
        logger.info("deleted; Kubernetes garbage-collects its Deployment, Service and PDB")


def _autoscaling_enabled(spec: Mapping[str, Any]) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


def _post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(body, type=type_, reason=reason, message=message)


def _supervise(
    memo: kopf.Memo, namespace: str, name: str, wanted: bool, logger: logging.Logger
) -> None:
    """Start the object's autoscaler loop when wanted and not running; stop it otherwise."""
    key = (namespace, name)
    running = memo.autoscalers.get(key)
    if wanted and (running is None or running[0].done()):
        stop = asyncio.Event()
        loop = autoscaler.run(
            memo.api,
            memo.http,
            memo.config,
            namespace,
            name,
            stop,
            _lock(memo, namespace, name),
            _post_event,
            logger,
        )
        task = asyncio.create_task(loop, name=f"autoscaler {namespace}/{name}")
        memo.autoscalers[key] = (task, stop)
    elif not wanted and running is not None:
        running[1].set()  # the loop releases its Lease and ends
        del memo.autoscalers[key]


async def _stop_autoscalers(memo: kopf.Memo, timeout: float = 5.0) -> None:
    loops = list(getattr(memo, "autoscalers", {}).values())
    for _, stop in loops:
        stop.set()
    tasks = [task for task, _ in loops]
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
