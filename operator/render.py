"""Pure functions: an LLMDeployment (+ its typed spec) -> the Kubernetes objects it owns.

Nothing here talks to the API. ``render_all`` returns plain dicts, each carrying the labels,
the ownerReference and a hash of its own content (``serving.kvscale.dev/spec-hash``) that
the reconciler compares instead of diffing server-defaulted objects.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from kvscale.operator import constants as c
from kvscale.operator.config import OperatorConfig
from kvscale.operator.spec import LLMDeploymentSpec, ModelSource

Obj = dict[str, Any]

CACHE_VOLUME = "model-cache"
SHM_VOLUME = "dshm"
TMP_VOLUME = "tmp"
DRAFT_SOCKET_VOLUME = "draft-socket"


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's selector (immutable, so minimal): one label naming the owner."""
    return {c.OWNER_LABEL: name}


def selector_string(name: str) -> str:
    """``status.selector`` for the scale subresource (what an HPA lists pods by)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def labels(name: str, component: str = "server") -> dict[str, str]:
    return {
        c.NAME_LABEL: c.SERVER_APP,
        c.INSTANCE_LABEL: name,
        c.COMPONENT_LABEL: component,
        c.PART_OF_LABEL: "kvscale",
        c.MANAGED_BY_LABEL: c.MANAGER,
        **selector_labels(name),
    }


def router_selector_labels(name: str) -> dict[str, str]:
    """The router Deployment's selector, disjoint from the server pods' (no OWNER_LABEL)."""
    return {c.ROUTER_LABEL: name}


def router_selector_string(name: str) -> str:
    """The label selector of the router pods."""
    return ",".join(f"{k}={v}" for k, v in router_selector_labels(name).items())


def router_labels(name: str) -> dict[str, str]:
    return {
        c.NAME_LABEL: c.ROUTER_APP,
        c.INSTANCE_LABEL: name,
        c.COMPONENT_LABEL: "router",
        c.PART_OF_LABEL: "kvscale",
        c.MANAGED_BY_LABEL: c.MANAGER,
        **router_selector_labels(name),
    }


def router_name(name: str) -> str:
    """The router's Deployment, ServiceAccount, Role and RoleBinding."""
    return f"{name}-router"


def replicas_service_name(name: str) -> str:
    """The headless Service over the server pods whose EndpointSlices the router reads."""
    return f"{name}-replicas"


def owner_reference(llmd: Mapping[str, Any]) -> Obj:
    meta = llmd["metadata"]
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(llmd: Mapping[str, Any], name: str, router: bool = False) -> Obj:
    meta = llmd["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": router_labels(meta["name"]) if router else labels(meta["name"]),
        "annotations": {},
        "ownerReferences": [owner_reference(llmd)],
    }


def spec_hash(obj: Mapping[str, Any]) -> str:
    """A stable hash of a rendered object, ignoring replicas and the hash itself."""
    body = copy.deepcopy(dict(obj))
    body.get("spec", {}).pop("replicas", None)
    body.get("metadata", {}).get("annotations", {}).pop(c.SPEC_HASH_ANNOTATION, None)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stamp(obj: Obj) -> Obj:
    obj["metadata"]["annotations"][c.SPEC_HASH_ANNOTATION] = spec_hash(obj)
    return obj


def endpoint(llmd: Mapping[str, Any], spec: LLMDeploymentSpec, config: OperatorConfig) -> str:
    """The in-cluster base URL of the Service (the OpenAI API lives under ``/v1``)."""
    meta = llmd["metadata"]
    host = f"{meta['name']}.{meta['namespace']}.svc.{config.cluster_domain}"
    return f"http://{host}:{spec.service.port}"


# --- model locations ---------------------------------------------------------------------------


def model_path(source: ModelSource, slot: str) -> str:
    """Where the server finds the weights of ``source`` (``slot``: model or draft)."""
    if source.scheme == "builtin":
        return "demo"
    if source.scheme == "pvc":
        base = f"{c.MODEL_ROOT}/{slot}-pvc"
        return f"{base}/{source.pvc_path}" if source.pvc_path else base
    return f"{c.MODEL_ROOT}/{slot}"


Sources = list[tuple[str, ModelSource]]  # (slot, source): slot is model or draft


def _sources(spec: LLMDeploymentSpec) -> Sources:
    """Every checkpoint the pod downloads or mounts: the model, then a draft model."""
    sources = [("model", spec.model.source)]
    if spec.speculative is not None and spec.speculative.draft_model is not None:
        sources.append(("draft", spec.speculative.draft_model))
    return sources


def _has_sidecar(spec: LLMDeploymentSpec) -> bool:
    """Whether the pod runs the draft model in a container of its own."""
    return spec.speculative is not None and spec.speculative.sidecar


def _container_sources(spec: LLMDeploymentSpec, container: str) -> Sources:
    """The checkpoints ``container`` (server or draft) reads: the sidecar's draft is its own,
    an in-process draft is the server's."""
    sidecar = _has_sidecar(spec)
    if container == "draft":
        return [(slot, s) for slot, s in _sources(spec) if slot == "draft"]
    return [(slot, s) for slot, s in _sources(spec) if slot == "model" or not sidecar]


def _download_container(
    source: ModelSource, slot: str, spec: LLMDeploymentSpec, config: OperatorConfig
) -> Obj | None:
    """The init container that fetches hf:// or s3:// weights into the cache volume."""
    mount = {"name": CACHE_VOLUME, "mountPath": c.MODEL_ROOT}
    return fetch_container(
        source, spec, config, f"{slot}-download", model_path(source, slot), mount
    )


def fetch_container(
    source: ModelSource,
    spec: LLMDeploymentSpec,
    config: OperatorConfig,
    name: str,
    dest: str,
    mount: Obj,
    only: tuple[str, ...] = (),
) -> Obj | None:
    """An init container that downloads an hf:// or s3:// source to ``dest`` (in the volume
    ``mount``), or only the files named in ``only``; None for other schemes."""
    if not source.needs_download:
        return None
    env = [{"name": "HOME", "value": "/tmp"}]
    if source.scheme == "hf":
        image = spec.image or config.server_image
        cmd = ["hf", "download", source.location, "--local-dir", dest]
        if only:
            cmd += ["--include", *only]
        if source.revision:
            cmd += ["--revision", source.revision]
        env += [
            {"name": "HF_HOME", "value": "/tmp/hf"},
            {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        ]
    else:
        image = config.s3_downloader_image
        cmd = ["aws", "s3", "sync", source.source, dest, "--only-show-errors"]
        if only:
            cmd += ["--exclude", "*"]
            for f in only:
                cmd += ["--include", f]
    container: Obj = {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": cmd,
        "env": env,
        "volumeMounts": [mount, {"name": TMP_VOLUME, "mountPath": "/tmp"}],
        "securityContext": _container_security(),
    }
    if source.credentials:
        # The token never appears in the spec or the pod: it comes from the Secret.
        container["envFrom"] = [{"secretRef": {"name": source.credentials.name}}]
    return container


# --- the server command line -------------------------------------------------------------------


def server_args(spec: LLMDeploymentSpec, port: int = c.SERVER_PORT) -> list[str]:
    """``kvscale serve`` flags for the target model, derived from the spec.

    Flags with the server's default value are left out, so a feature the server does not
    implement yet is only asked for when the spec really asks for it.
    """
    eng, model = spec.engine, spec.model
    args = [
        "serve",
        "--model", model_path(model.source, "model"),
        "--served-model-name", model.served_model_name,
        "--host", "0.0.0.0",
        "--port", str(port),
        "--device", eng.device,
        "--dtype", model.dtype,
        "--drain-timeout", str(spec.lifecycle.drain_timeout_seconds),
    ]  # fmt: skip
    if eng.max_num_seqs is not None:
        args += ["--max-num-seqs", str(eng.max_num_seqs)]
    if eng.device == "cuda":
        args += ["--gpu-memory-utilization", f"{eng.gpu_memory_utilization:g}"]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if eng.block_size is not None:
        args += ["--block-size", str(eng.block_size)]
    if eng.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(eng.max_num_batched_tokens)]
    if eng.max_queue_len is not None:
        args += ["--max-queue-len", str(eng.max_queue_len)]
    if eng.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(eng.tensor_parallel_size)]
    if eng.quantization != "none":
        args += ["--quantization", eng.quantization]
    if eng.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", eng.kv_cache_dtype]
    if not eng.prefix_caching:  # on by default in the server
        args.append("--no-enable-prefix-caching")
    args += speculative_args(spec)
    # An API key reaches the server as $KVSCALE_API_KEY from the Secret, never as a flag.
    return args + list(eng.extra_args)


def speculative_args(spec: LLMDeploymentSpec) -> list[str]:
    """``kvscale serve`` flags of ``spec.speculative`` (none without it). The n-gram sizes
    and the batch-size cut-off are only rendered when the spec sets them."""
    sp = spec.speculative
    if sp is None:
        return []
    args = [
        "--speculative-method", sp.method,
        "--num-speculative-tokens", str(sp.num_speculative_tokens),
    ]  # fmt: skip
    if sp.draft_model is not None and sp.placement is not None:
        # A sidecar is reached on the pod's shared socket; in process, the draft's weights
        # sit in the pod's model volume like the target's.
        where = f"unix://{c.DRAFT_SOCKET}" if sp.sidecar else model_path(sp.draft_model, "draft")
        args += ["--speculative-model", where, "--speculative-placement", sp.placement]
    if sp.ngram_min is not None:
        args += ["--ngram-min", str(sp.ngram_min)]
    if sp.ngram_max is not None:
        args += ["--ngram-max", str(sp.ngram_max)]
    if sp.disable_by_batch_size is not None:
        args += ["--speculative-disable-by-batch-size", str(sp.disable_by_batch_size)]
    return args


def _draft_gpus(spec: LLMDeploymentSpec) -> int:
    """GPUs of the draft sidecar: as spec.speculative.resources asks, none on CPU pods."""
    assert spec.speculative is not None
    return spec.speculative.resources.gpus if spec.engine.device == "cuda" else 0


def draft_args(spec: LLMDeploymentSpec) -> list[str]:
    """``kvscale serve-draft`` flags for the draft sidecar: the draft model behind the
    pod's Unix socket (no TCP port), sized for the target's batch and context."""
    sp = spec.speculative
    assert sp is not None and sp.draft_model is not None and sp.sidecar
    args = [
        "serve-draft",
        "--model", model_path(sp.draft_model, "draft"),
        "--socket", c.DRAFT_SOCKET,
        "--device", "cuda" if _draft_gpus(spec) else "cpu",
        "--dtype", spec.model.dtype,
    ]  # fmt: skip
    if spec.engine.max_num_seqs is not None:  # else both default to 256 with speculation
        args += ["--max-num-seqs", str(spec.engine.max_num_seqs)]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    return args


# --- containers --------------------------------------------------------------------------------


def _container_security() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _resources(cpu: str | None, memory: str | None, gpus: int) -> Obj:
    requests: Obj = {}
    limits: Obj = {}
    if cpu:
        requests["cpu"] = cpu
    if memory:
        requests["memory"] = limits["memory"] = memory
    if gpus:
        requests[c.GPU_RESOURCE] = limits[c.GPU_RESOURCE] = str(gpus)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _base_env() -> list[Obj]:
    """Writable places under /tmp (the root filesystem is read-only); weights are local."""
    return [
        {"name": "HOME", "value": "/tmp"},
        {"name": "KVSCALE_CACHE", "value": "/tmp/kvscale"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
    ]


def _server_env(spec: LLMDeploymentSpec) -> list[Obj]:
    env = _base_env()
    if spec.service.api_key:
        ref = spec.service.api_key
        env.append(
            {
                "name": "KVSCALE_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    return env + [dict(e) for e in spec.env]


def _model_mounts(sources: Sources) -> list[Obj]:
    mounts: list[Obj] = []
    if any(s.needs_download for _, s in sources):
        mounts.append({"name": CACHE_VOLUME, "mountPath": c.MODEL_ROOT, "readOnly": True})
    for slot, source in sources:
        if source.scheme == "pvc":
            path = f"{c.MODEL_ROOT}/{slot}-pvc"
            mounts.append({"name": f"{slot}-pvc", "mountPath": path, "readOnly": True})
    return mounts


def _socket_mounts(spec: LLMDeploymentSpec) -> list[Obj]:
    """The draft sidecar's socket folder, in the server and the sidecar alike."""
    if not _has_sidecar(spec):
        return []
    return [{"name": DRAFT_SOCKET_VOLUME, "mountPath": c.DRAFT_SOCKET_DIR}]


def _volumes(spec: LLMDeploymentSpec) -> list[Obj]:
    volumes: list[Obj] = [{"name": TMP_VOLUME, "emptyDir": {}}]
    sources = _sources(spec)
    if any(s.needs_download for _, s in sources):
        cache: Obj = {}
        if spec.model.cache_size:
            cache["sizeLimit"] = spec.model.cache_size
        volumes.append({"name": CACHE_VOLUME, "emptyDir": cache})
    for slot, source in sources:
        if source.scheme == "pvc":
            volumes.append(
                {
                    "name": f"{slot}-pvc",
                    "persistentVolumeClaim": {"claimName": source.pvc_claim, "readOnly": True},
                }
            )
    if _has_sidecar(spec):
        volumes.append({"name": DRAFT_SOCKET_VOLUME, "emptyDir": {}})
    if spec.engine.tensor_parallel_size > 1:
        # NCCL moves tensors between ranks through /dev/shm; the container default is 64 MiB.
        volumes.append(
            {
                "name": SHM_VOLUME,
                "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory_size},
            }
        )
    return volumes


def _probes(spec: LLMDeploymentSpec) -> Obj:
    """Startup covers the model load; liveness and readiness only start after it."""
    period = 10
    return {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": period,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(spec.lifecycle.startup_timeout_seconds / period)),
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": "http"},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 15,
            "timeoutSeconds": 10,
            "failureThreshold": 4,
        },
    }


def _pre_stop(spec: LLMDeploymentSpec) -> Obj:
    """Keep serving while endpoints drop the pod; SIGTERM then drains in-flight requests."""
    delay = spec.lifecycle.pre_stop_delay_seconds
    if not delay:
        return {}
    return {"lifecycle": {"preStop": {"exec": {"command": ["sleep", str(delay)]}}}}


def _server_container(spec: LLMDeploymentSpec, config: OperatorConfig) -> Obj:
    mounts = [
        {"name": TMP_VOLUME, "mountPath": "/tmp"},
        *_model_mounts(_container_sources(spec, "server")),
        *_socket_mounts(spec),
    ]
    if spec.engine.tensor_parallel_size > 1:
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    res = spec.resources
    return {
        "name": "server",
        "image": spec.image or config.server_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvscale"],
        "args": server_args(spec),
        "ports": [{"name": "http", "containerPort": c.SERVER_PORT, "protocol": "TCP"}],
        "env": _server_env(spec),
        "resources": _resources(res.cpu, res.memory, spec.gpus_per_replica),
        "volumeMounts": mounts,
        **_probes(spec),
        **_pre_stop(spec),
        "securityContext": _container_security(),
    }


def _draft_container(spec: LLMDeploymentSpec, config: OperatorConfig) -> Obj:
    """The draft sidecar. Its probes look for the socket, which appears once the draft
    model has loaded (startup: the same budget as the server's model load)."""
    assert spec.speculative is not None
    res = spec.speculative.resources
    socket_exists = {"exec": {"command": ["test", "-S", c.DRAFT_SOCKET]}}
    return {
        "name": "draft",
        "image": spec.image or config.server_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvscale"],
        "args": draft_args(spec),
        "env": _base_env(),
        "resources": _resources(res.cpu, res.memory, _draft_gpus(spec)),
        "volumeMounts": [
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
            *_model_mounts(_container_sources(spec, "draft")),
            *_socket_mounts(spec),
        ],
        "startupProbe": {
            **socket_exists,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, math.ceil(spec.lifecycle.startup_timeout_seconds / 10)),
        },
        "readinessProbe": {
            **socket_exists,
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        **_pre_stop(spec),
        "securityContext": _container_security(),
    }


def _scheduling(spec: LLMDeploymentSpec) -> Obj:
    res = spec.resources
    out: Obj = {}
    selector = dict(res.node_selector)
    if res.gpu_type:
        selector[c.GPU_PRODUCT_LABEL] = res.gpu_type
    if selector:
        out["nodeSelector"] = selector
    tolerations = [dict(t) for t in res.tolerations]
    gpu_toleration = {"key": c.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    if spec.gpus_per_replica and gpu_toleration not in tolerations:
        tolerations.append(gpu_toleration)  # GPU nodes are commonly tainted this way
    if tolerations:
        out["tolerations"] = tolerations
    if res.affinity:
        out["affinity"] = copy.deepcopy(dict(res.affinity))
    return out


# --- the owned objects -------------------------------------------------------------------------


def render_deployment(
    llmd: Mapping[str, Any], spec: LLMDeploymentSpec, config: OperatorConfig, replicas: int
) -> Obj:
    name = llmd["metadata"]["name"]
    init = [
        ctr
        for ctr in (
            _download_container(source, slot, spec, config) for slot, source in _sources(spec)
        )
        if ctr
    ]
    containers = [_server_container(spec, config)]
    if _has_sidecar(spec):
        containers.append(_draft_container(spec, config))
    lc = spec.lifecycle
    pod_spec: Obj = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": c.RUN_AS_USER,
            "runAsGroup": c.RUN_AS_USER,
            "fsGroup": c.RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": lc.pre_stop_delay_seconds + lc.drain_timeout_seconds + 30,
        **({"initContainers": init} if init else {}),
        "containers": containers,
        "volumes": _volumes(spec),
        **_scheduling(spec),
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(llmd, name),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(name)},
            # A surge pod keeps capacity during a rollout (it needs one spare replica's GPUs).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            # Model loads are slow: only call a rollout stuck well after the startup budget.
            "progressDeadlineSeconds": lc.startup_timeout_seconds + 600,
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": labels(name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(c.SERVER_PORT),
                        "prometheus.io/path": "/metrics",
                        "kubectl.kubernetes.io/default-container": "server",
                    },
                },
                "spec": pod_spec,
            },
        },
    }
    return _stamp(obj)


def render_service(llmd: Mapping[str, Any], spec: LLMDeploymentSpec) -> Obj:
    """The LLMDeployment's Service: over the router pods when the router is enabled, else
    over the server pods."""
    name = llmd["metadata"]["name"]
    meta = _metadata(llmd, name)
    meta["annotations"].update(spec.service.annotations)
    selector = router_selector_labels(name) if spec.router.enabled else selector_labels(name)
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": spec.service.type,
            "selector": selector,
            "ports": [
                {"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    return _stamp(obj)


def wants_pdb(spec: LLMDeploymentSpec) -> bool:
    """A PodDisruptionBudget only makes sense when more than one replica can run."""
    if spec.autoscaling.enabled:
        return spec.autoscaling.max_replicas > 1
    return spec.replicas > 1


def render_pdb(llmd: Mapping[str, Any], spec: LLMDeploymentSpec) -> Obj | None:
    if not wants_pdb(spec):
        return None
    name = llmd["metadata"]["name"]
    obj = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(llmd, name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(name)},
            # A pod that never got ready (e.g. a bad model) must not block node drains.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
    return _stamp(obj)


def render_all(
    llmd: Mapping[str, Any], spec: LLMDeploymentSpec, config: OperatorConfig, replicas: int
) -> list[Obj]:
    """Every object the LLMDeployment owns, in the order they are applied: the router's
    (when enabled) before the Service that selects its pods."""
    from kvscale.operator.render_router import render_router  # it builds on this module

    objs = [render_deployment(llmd, spec, config, replicas)]
    objs += render_router(llmd, spec, config)
    objs.append(render_service(llmd, spec))
    pdb = render_pdb(llmd, spec)
    if pdb:
        objs.append(pdb)
    return objs
