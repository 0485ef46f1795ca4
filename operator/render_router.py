"""Pure functions: the router objects of an LLMDeployment with ``spec.router.enabled``.

``kvscale route`` pods (a Deployment) read the server pods' ready addresses from the
EndpointSlices of a headless Service over them (``<name>-replicas``), with a ServiceAccount
whose Role may only read EndpointSlices and pods in the namespace. The LLMDeployment's own
Service then selects the router pods (:func:`kvscale.operator.render.render_service`).

The router's objects carry ``serving.kvscale.dev/router: <name>`` instead of the owner
label, so that the server Deployment's selector, the autoscaler's pod list and the child
indexes never see them; they are owned (garbage-collected) all the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvscale.operator import constants as c
from kvscale.operator.config import OperatorConfig
from kvscale.operator.render import (
    Obj,
    _container_security,
    _metadata,
    _resources,
    _stamp,
    fetch_container,
    replicas_service_name,
    router_labels,
    router_name,
    router_selector_labels,
    selector_labels,
)
from kvscale.operator.spec import LLMDeploymentSpec, ModelSource

TOKENIZER_VOLUME = "tokenizer"
TOKENIZER_PVC_VOLUME = "tokenizer-pvc"
# What the router needs of a checkpoint to tokenize and render chat prompts as the server.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)
DEFAULT_BLOCK_SIZE = 16  # the server's --block-size default


def router_kinds() -> tuple[str, ...]:
    """The kinds :func:`render_router` returns, in order (for pruning when disabled)."""
    return ("ServiceAccount", "Role", "RoleBinding", "Service", "Deployment")


def router_object_names(name: str) -> list[tuple[str, str]]:
    """(kind, name) of every router object of LLMDeployment ``name``."""
    return [
        (kind, replicas_service_name(name) if kind == "Service" else router_name(name))
        for kind in router_kinds()
    ]


def tokenizer_path(source: ModelSource) -> str | None:
    """Where the router finds the model's tokenizer, or None (``builtin://demo``: the router
    then gives prefix affinity to token-id prompts only)."""
    if source.scheme == "builtin":
        return None
    if source.scheme == "pvc":
        root = f"{c.TOKENIZER_ROOT}-pvc"
        return f"{root}/{source.pvc_path}" if source.pvc_path else root
    return c.TOKENIZER_ROOT


def router_args(llmd: Mapping[str, Any], spec: LLMDeploymentSpec) -> list[str]:
    """``kvscale route`` flags: the replicas from the EndpointSlices of ``<name>-replicas``."""
    meta = llmd["metadata"]
    rt = spec.router
    args = [
        "route",
        "--endpoint-slices", f"{meta['namespace']}/{replicas_service_name(meta['name'])}",
        "--endpoint-port", "http",
        "--policy", rt.policy,
        "--block-size", str(spec.engine.block_size or DEFAULT_BLOCK_SIZE),
        "--hold-timeout", str(rt.hold_timeout_seconds),
        "--hold-queue-size", str(rt.hold_queue_size),
        "--drain-timeout", str(spec.lifecycle.drain_timeout_seconds),
        "--host", "0.0.0.0",
        "--port", str(c.ROUTER_PORT),
    ]  # fmt: skip
    tok = tokenizer_path(spec.model.source)
    if rt.policy == "prefix" and tok is not None:
        args += ["--tokenizer", tok]
    return args


def _router_env(spec: LLMDeploymentSpec) -> list[Obj]:
    env: list[Obj] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if spec.service.api_key:
        ref = spec.service.api_key
        env.append(
            {
                "name": "KVSCALE_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    return env


def render_router_deployment(
    llmd: Mapping[str, Any], spec: LLMDeploymentSpec, config: OperatorConfig
) -> Obj:
    name = llmd["metadata"]["name"]
    rt = spec.router
    source = spec.model.source
    mounts: list[Obj] = [{"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[Obj] = [{"name": "tmp", "emptyDir": {}}]
    init = []
    wants_tokenizer = rt.policy == "prefix" and tokenizer_path(source) is not None
    if wants_tokenizer and source.scheme == "pvc":
        root = f"{c.TOKENIZER_ROOT}-pvc"
        mounts.append({"name": TOKENIZER_PVC_VOLUME, "mountPath": root, "readOnly": True})
        claim = {"claimName": source.pvc_claim, "readOnly": True}
        volumes.append({"name": TOKENIZER_PVC_VOLUME, "persistentVolumeClaim": claim})
    elif wants_tokenizer:
        mounts.append({"name": TOKENIZER_VOLUME, "mountPath": c.TOKENIZER_ROOT, "readOnly": True})
        volumes.append({"name": TOKENIZER_VOLUME, "emptyDir": {}})
        mount = {"name": TOKENIZER_VOLUME, "mountPath": c.TOKENIZER_ROOT}
        fetch = fetch_container(
            source, spec, config, "tokenizer-download", c.TOKENIZER_ROOT, mount, TOKENIZER_FILES
        )
        init.append(fetch)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    container: Obj = {
        "name": "router",
        "image": spec.image or config.server_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvscale"],
        "args": router_args(llmd, spec),
        "ports": [{"name": "http", "containerPort": c.ROUTER_PORT, "protocol": "TCP"}],
        "env": _router_env(spec),
        "resources": _resources(rt.cpu, rt.memory, 0),
        "volumeMounts": mounts,
        # Ready with no replica behind it: it holds requests (scale from zero).
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4},
        "securityContext": _container_security(),
    }
    lc = spec.lifecycle
    pod_spec: Obj = {
        "serviceAccountName": router_name(name),
        "automountServiceAccountToken": True,  # it lists EndpointSlices
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": c.RUN_AS_USER,
            "runAsGroup": c.RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": lc.drain_timeout_seconds + 30,
        **({"initContainers": init} if init else {}),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(llmd, router_name(name), router=True),
        "spec": {
            "replicas": rt.replicas,
            "selector": {"matchLabels": router_selector_labels(name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": router_labels(name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(c.ROUTER_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }
    return _stamp(obj)


def render_replicas_service(llmd: Mapping[str, Any]) -> Obj:
    """Headless: its EndpointSlices list each ready server pod's own address."""
    name = llmd["metadata"]["name"]
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(llmd, replicas_service_name(name), router=True),
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "None",
            "selector": selector_labels(name),
            "ports": [
                {"name": "http", "port": c.SERVER_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    return _stamp(obj)


def render_rbac(llmd: Mapping[str, Any]) -> list[Obj]:
    """ServiceAccount, Role (read EndpointSlices and pods in the namespace) and RoleBinding."""
    name = llmd["metadata"]["name"]
    ns = llmd["metadata"]["namespace"]
    sa = router_name(name)
    read = ["get", "list", "watch"]
    objs = [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _metadata(llmd, sa, router=True),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(llmd, sa, router=True),
            "rules": [
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
                {"apiGroups": [""], "resources": ["pods"], "verbs": read},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(llmd, sa, router=True),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        },
    ]
    return [_stamp(o) for o in objs]


def render_router(
    llmd: Mapping[str, Any], spec: LLMDeploymentSpec, config: OperatorConfig
) -> list[Obj]:
    """The router's objects in the order of :func:`router_kinds` (none when disabled)."""
    if not spec.router.enabled:
        return []
    return [
        *render_rbac(llmd),
        render_replicas_service(llmd),
        render_router_deployment(llmd, spec, config),
    ]
