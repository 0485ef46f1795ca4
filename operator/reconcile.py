"""One reconcile pass for an LLMDeployment: render, apply what changed, report status.

The pass is idempotent: children whose rendered hash and replica count match are not
written, and the status is only patched when a field the operator owns changed. Problems it
cannot fix (a missing Secret, a name taken by someone else's object, unschedulable pods) end
up in the Degraded condition and in Warning events instead of exceptions.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvscale.operator import constants as c
from kvscale.operator import render
from kvscale.operator.config import OperatorConfig
from kvscale.operator.kube import KINDS, PDBS, PODS, SECRETS, ApiError, KubeClient, Resource
from kvscale.operator.spec import LLMDeploymentSpec, SpecError, desired_replicas, parse_spec
from kvscale.operator.status import (
    Problem,
    compute_status,
    deployment_problems,
    pod_problems,
    status_patch,
)

LLMDEPLOYMENTS = Resource(c.API_VERSION, c.PLURAL)
SERVICE_KEPT_FIELDS = (
    "clusterIP",
    "clusterIPs",
    "ipFamilies",
    "ipFamilyPolicy",
    "healthCheckNodePort",
)
STATUS_ATTEMPTS = 5  # status patches per pass, each recomputed after a 409
# Keys a Secret must hold, by what it is used for.
CREDENTIAL_KEYS = {"hf": ("HF_TOKEN",), "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}

Obj = dict[str, Any]


class Conflict(Exception):
    """The object changed under us (HTTP 409); the next pass will see the new version."""


@dataclass
class Outcome:
    """What a pass did and found, for the handlers to turn into events and retries."""

    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    problems: list[Problem] = field(default_factory=list)
    invalid: SpecError | None = None
    retry: bool = False  # something outside the cluster objects we own must change first
    status: Obj | None = None
    status_written: bool = False
    status_version: str | None = None  # the resourceVersion the status write made


def now_iso() -> str:
    return (
        datetime.datetime.now(datetime.UTC)
        .replace(microsecond=0)
        .isoformat()
        .replace("+00:00", "Z")
    )


def _is_owned(live: Mapping[str, Any], uid: str) -> bool:
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def _merge_for_update(live: Mapping[str, Any], desired: Obj) -> Obj:
    """The desired object as a full update of ``live``: keep server-allocated fields."""
    body = copy.deepcopy(desired)
    lmeta = live.get("metadata", {})
    meta = body["metadata"]
    meta["resourceVersion"] = lmeta.get("resourceVersion")
    meta["labels"] = {**(lmeta.get("labels") or {}), **meta["labels"]}
    meta["annotations"] = {**(lmeta.get("annotations") or {}), **meta["annotations"]}
    if body["kind"] == "Service":
        lspec = live.get("spec") or {}
        for key in SERVICE_KEPT_FIELDS:
            if key in lspec:
                body["spec"][key] = lspec[key]
        node_ports = {p.get("name"): p.get("nodePort") for p in lspec.get("ports") or ()}
        if body["spec"]["type"] != "ClusterIP":
            for port in body["spec"]["ports"]:
                if node_ports.get(port["name"]):
                    port["nodePort"] = node_ports[port["name"]]
    return body


class ChildCache(Protocol):
    """The owned objects as the operator's watches last saw them (kopf indexes), so that a
    pass reads nothing from the API when nothing changed. May lag behind the API; a pass
    that writes reads the object fresh first."""

    def child(self, kind: str, namespace: str, name: str) -> Obj | None: ...

    def pods(self, namespace: str, name: str) -> list[Obj]: ...

    def router(self, namespace: str, name: str) -> Obj | None:
        """The router Deployment of LLMDeployment ``name``, if watched."""
        ...


def _up_to_date(live: Mapping[str, Any] | None, desired: Obj, owner_uid: str) -> bool:
    if live is None or not _is_owned(live, owner_uid):
        return False
    want_hash = desired["metadata"]["annotations"][c.SPEC_HASH_ANNOTATION]
    have_hash = (live["metadata"].get("annotations") or {}).get(c.SPEC_HASH_ANNOTATION)
    want_replicas = desired.get("spec", {}).get("replicas")
    return want_hash == have_hash and (
        want_replicas is None or (live.get("spec") or {}).get("replicas") == want_replicas
    )


async def apply(
    api: KubeClient, desired: Obj, owner_uid: str, cached: Mapping[str, Any] | None = None
) -> tuple[Obj, str | None]:
    """Create or update one child; returns (live object, action or None when untouched).
    ``cached``: the object as last watched; when it is already as desired, no request."""
    if cached is not None and _up_to_date(cached, desired, owner_uid):
        return dict(cached), None
    res = KINDS[desired["kind"]]
    ns, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
    path = res.path(ns, name)
    live = await api.get(path)
    if live is None:
        try:
            return await api.create(res.path(ns), desired), "Created"
        except ApiError as e:
            if e.status != 409:
                raise
            raise Conflict(f"{desired['kind']} {ns}/{name} appeared while creating it") from e
    if not _is_owned(live, owner_uid):
        raise _NotOwned(desired["kind"], ns, name)
    want_hash = desired["metadata"]["annotations"][c.SPEC_HASH_ANNOTATION]
    have_hash = (live["metadata"].get("annotations") or {}).get(c.SPEC_HASH_ANNOTATION)
    try:
        if want_hash != have_hash:
            return await api.replace(path, _merge_for_update(live, desired)), "Updated"
        want_replicas = desired.get("spec", {}).get("replicas")
        if want_replicas is not None and live["spec"].get("replicas") != want_replicas:
            patched = await api.patch(path, {"spec": {"replicas": want_replicas}})
            return patched, f"Scaled:{live['spec'].get('replicas')}"
    except ApiError as e:
        if e.status == 409:
            raise Conflict(f"{desired['kind']} {ns}/{name} changed while updating it") from e
        raise
    return live, None


class _NotOwned(Exception):
    def __init__(self, kind: str, ns: str, name: str) -> None:
        super().__init__(kind, ns, name)
        self.problem = Problem(
            "NameConflict",
            f"{kind} {ns}/{name} already exists and is not owned by this LLMDeployment; "
            "delete or rename it, or rename the LLMDeployment",
        )


def _cached(cache: ChildCache | None, obj: Obj, ns: str, name: str) -> Obj | None:
    """The watched copy of ``obj``, if one may be trusted: the owner-labelled children (the
    router's come from their own index). The PDB comes and goes with the replica count:
    never trust a watched copy of it (the watch may not have seen our own delete yet)."""
    if cache is None or obj["kind"] == "PodDisruptionBudget":
        return None
    if obj["metadata"]["name"] == name:
        return cache.child(obj["kind"], ns, name)
    if obj["kind"] == "Deployment":
        return cache.router(ns, name)
    return None  # the router's RBAC and Service: read (only while the router is enabled)


def _router_support(obj: Obj, name: str) -> bool:
    """The router's RBAC objects and its replicas Service (not watched)."""
    if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
        return True
    return obj["kind"] == "Service" and obj["metadata"]["name"] != name


def _router_settled(
    cache: ChildCache | None, objs: list[Obj], ns: str, name: str, uid: str
) -> bool:
    """Whether the watched router Deployment is as rendered: its RBAC objects and Service
    were applied before it in the pass that wrote it, so a pass (e.g. for a pod event)
    need not read them again. (One deleted by hand comes back at the next change of the
    spec or the router Deployment.)"""
    if cache is None:
        return False
    want = next(
        (o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] != name), None
    )
    return want is not None and _up_to_date(cache.router(ns, name), want, uid)


async def _prune_router(
    api: KubeClient, cache: ChildCache | None, ns: str, name: str, uid: str
) -> list[tuple[str, str, str]]:
    """Deletes the router's objects after ``spec.router`` was disabled. The watched router
    Deployment only says whether to look (without a cache: always look)."""
    from kvscale.operator.render_router import router_object_names

    if cache is not None and cache.router(ns, name) is None:
        return []
    router_path = KINDS["Deployment"].path(ns, render.router_name(name))
    if cache is None and await api.get(router_path) is None:
        return []
    deleted = []
    for kind, obj_name in reversed(router_object_names(name)):
        path = KINDS[kind].path(ns, obj_name)
        live = await api.get(path)
        if live is not None and _is_owned(live, uid):
            await api.delete(path)
            deleted.append(f"{kind} {obj_name}")
    if not deleted:
        return []
    message = (
        f"deleted {', '.join(deleted)}: spec.router is disabled, the Service selects the "
        "server pods again"
    )
    return [("Normal", "Deleted", message)]


async def check_secrets(api: KubeClient, ns: str, spec: LLMDeploymentSpec) -> list[Problem]:
    """Every Secret the pods will read must exist with the keys they read."""
    wanted: list[tuple[str, str, tuple[str, ...]]] = []
    for field_path, source in (
        ("spec.model.credentialsSecretRef", spec.model.source),
        (
            "spec.speculative.draftModel.credentialsSecretRef",
            spec.speculative and spec.speculative.draft_model,
        ),
    ):
        if source and source.credentials:
            wanted.append((field_path, source.credentials.name, CREDENTIAL_KEYS[source.scheme]))
    if spec.service.api_key:
        ref = spec.service.api_key
        wanted.append(("spec.service.apiKeySecretRef", ref.name, (ref.key or "api-key",)))
    by_secret: dict[str, tuple[list[str], list[str]]] = {}  # name -> (fields, keys)
    for field_path, name, keys in wanted:
        fields, all_keys = by_secret.setdefault(name, ([], []))
        fields.append(field_path)
        all_keys.extend(k for k in keys if k not in all_keys)
    problems = []
    for name, (fields, keys) in by_secret.items():
        where = " and ".join(fields)
        secret = await api.get(SECRETS.path(ns, name))
        if secret is None:
            example = " ".join(f"--from-literal={k}=..." for k in keys)
            problems.append(
                Problem(
                    "SecretNotFound",
                    f"Secret {ns}/{name} (from {where}) does not exist; create it: "
                    f"kubectl -n {ns} create secret generic {name} {example}",
                )
            )
            continue
        have = set(secret.get("data") or {}) | set(secret.get("stringData") or {})
        missing = [k for k in keys if k not in have]
        if missing:
            problems.append(
                Problem(
                    "SecretKeyMissing",
                    f"Secret {ns}/{name} (from {where}) has no key {', '.join(missing)}; "
                    "add it to the Secret",
                )
            )
    return problems


def _events_for(action: str, obj: Mapping[str, Any], replicas: int | None) -> tuple[str, str, str]:
    kind, name = obj["kind"], obj["metadata"]["name"]
    if action == "Created":
        return ("Normal", "Created", f"created {kind} {name}")
    if action == "Updated":
        what = "the pod template changed, pods roll" if kind == "Deployment" else "its spec changed"
        return ("Normal", "Updated", f"updated {kind} {name}: {what}")
    before = action.split(":", 1)[1]
    return ("Normal", "Scaled", f"scaled Deployment {name} from {before} to {replicas} replicas")


async def reconcile(
    api: KubeClient,
    llmd: Mapping[str, Any],
    config: OperatorConfig,
    *,
    now: str | None = None,
    cache: ChildCache | None = None,
) -> Outcome:
    """Bring the children of ``llmd`` to what its spec renders to, then update its status.
    ``cache``: the watched children and pods (else they are read from the API)."""
    now = now or now_iso()
    meta = llmd["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    out = Outcome()
    deployment: Obj | None = None
    spec: LLMDeploymentSpec | None = None
    desired = 0
    try:
        spec = parse_spec(llmd.get("spec"))
    except SpecError as e:
        out.invalid = e
        out.problems.append(Problem("InvalidSpec", str(e)))
    if spec is not None:
        desired = desired_replicas(spec, llmd.get("status"))
        out.problems += await check_secrets(api, ns, spec)
        out.retry = bool(out.problems)  # a Secret may appear
    if spec is not None and not out.problems:
        try:
            objs = render.render_all(llmd, spec, config, desired)
            settled = _router_settled(cache, objs, ns, name, uid)
            for obj in objs:
                if settled and _router_support(obj, name):
                    continue
                cached = _cached(cache, obj, ns, name)
                live, action = await apply(api, obj, uid, cached)
                if obj["kind"] == "Deployment" and obj["metadata"]["name"] == name:
                    deployment = live
                if action:
                    replicas = obj.get("spec", {}).get("replicas")
                    out.events.append(_events_for(action, obj, replicas))
            if not spec.router.enabled:
                out.events += await _prune_router(api, cache, ns, name, uid)
            if not render.wants_pdb(spec):
                # The watched copy only says whether to look (a PDB's own events reconcile
                # its owner, so one the watch had not seen yet is deleted on its ADDED).
                seen = cache is None or cache.child("PodDisruptionBudget", ns, name) is not None
                pdb = await api.get(PDBS.path(ns, name)) if seen else None
                if pdb is not None and _is_owned(pdb, uid):
                    await api.delete(PDBS.path(ns, name))
                    out.events.append(
                        (
                            "Normal",
                            "Deleted",
                            f"deleted PodDisruptionBudget {name}: at most one replica",
                        )
                    )
        except _NotOwned as e:
            out.problems.append(e.problem)
            out.retry = True  # nothing of ours changes when the intruder goes: look again
        except ApiError as e:
            # Refused (403 RBAC, 422 invalid, quota...) or the API is in trouble (5xx):
            # report it and try again later instead of failing the handler.
            out.problems.append(Problem("ApplyFailed", f"cannot write the owned objects: {e}"))
            out.retry = True
    if deployment is None:
        if cache is not None:
            live = cache.child("Deployment", ns, name)
        else:
            live = await api.get(KINDS["Deployment"].path(ns, name))
        deployment = live if live is not None and _is_owned(live, uid) else None
    if deployment is not None and spec is not None:
        if cache is not None:
            pods = cache.pods(ns, name)
        else:
            pods = await api.list(PODS.path(ns), render.selector_string(name))
        out.problems += pod_problems(pods, spec)
    out.problems += deployment_problems(deployment)

    # The status is written against the resourceVersion it was computed from: the
    # autoscaler writes ScalingActive (and the replica counts) meanwhile, and a merge patch
    # of a stale conditions list would put its old verdict back. On a conflict the pass
    # recomputes from a fresh read, up to STATUS_ATTEMPTS times, then raises Conflict (the
    # create/update handler retries the pass a second later): a change to the status
    # alone (the autoscaler's) triggers no later pass, so a pass that gave up could leave
    # e.g. status.replicas stale (seen once in CI with two operators).
    for attempt in range(1, STATUS_ATTEMPTS + 1):
        status = compute_status(
            llmd,
            spec,
            deployment,
            out.problems,
            desired=desired
            if spec is not None
            else int((llmd.get("status") or {}).get("desiredReplicas") or 0),
            selector=render.selector_string(name),
            endpoint=render.endpoint(llmd, spec, config)
            if spec is not None
            else (llmd.get("status") or {}).get("endpoint"),
            now=now,
        )
        patch = status_patch(llmd.get("status"), status)
        if not patch:
            break
        body: dict[str, Any] = {"status": patch}
        version = llmd["metadata"].get("resourceVersion")
        if version is not None:
            body["metadata"] = {"resourceVersion": version}
        try:
            written = await api.patch(LLMDEPLOYMENTS.path(ns, name, "status"), body)
            out.status_written = True
            out.status_version = (written.get("metadata") or {}).get("resourceVersion")
            break
        except ApiError as e:
            if e.status == 404:  # deleted meanwhile, nothing to report to
                break
            if e.status != 409:
                raise
            if attempt == STATUS_ATTEMPTS:  # the handler retries the whole pass
                raise Conflict(
                    f"LLMDeployment {ns}/{name}: its status changed under each of "
                    f"{STATUS_ATTEMPTS} status writes"
                ) from e
            fresh = await api.get(LLMDEPLOYMENTS.path(ns, name))
            if fresh is None:
                break
            llmd = fresh
    out.status = status
    out.events += _condition_events(llmd.get("status") or {}, status)
    return out


def _cond(status: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    for cond in status.get("conditions") or ():
        if cond.get("type") == type_:
            return cond
    return {}


def _condition_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """Warnings when a new problem shows up, Normal events when it clears or all is ready."""
    events = []
    was, now = _cond(old, c.DEGRADED), _cond(new, c.DEGRADED)
    if now.get("status") == "True" and (was.get("status"), was.get("message")) != (
        "True",
        now.get("message"),
    ):
        events.append(("Warning", now["reason"], now["message"]))
    if now.get("status") == "False" and was.get("status") == "True":
        events.append(("Normal", "Recovered", f"no longer degraded (was {was.get('reason')})"))
    was, now = _cond(old, c.READY), _cond(new, c.READY)
    if now.get("status") == "True" and was.get("status") != "True":
        events.append(("Normal", "Ready", now["message"]))
    return events
