"""Typed parsing of an LLMDeployment's ``spec`` with the CRD's defaults and rules.

The CRD (``crds/``) defaults and validates on the API server; this module applies the same
defaults and rules again so that the operator never acts on a spec the server would refuse
(an old CRD, a cluster without CEL, a test calling the renderers directly). Every error names
the field, e.g. ``spec.engine.tensorParallelSize: must be 1, 2, 4 or 8 (got 3)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscale.operator import admission, server_flags

TP_SIZES = (1, 2, 4, 8)
DEVICES = ("cuda", "cpu")
QUANTIZATIONS = ("none", "fp8", "awq", "gptq")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = ("auto", "float16", "bfloat16", "float32")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
ROUTER_POLICIES = ("prefix", "least-loaded", "random")
SPECULATIVE_METHODS = ("draft", "ngram")
PLACEMENTS = ("sidecar", "inprocess")
NGRAM_RANGE = (1, 16)  # n of --ngram-min / --ngram-max
NGRAM_DEFAULTS = (2, 4)  # the server's --ngram-min / --ngram-max when not rendered
# Flags the operator derives from the spec (extraArgs may not name them, even by a prefix),
# env names it sets, patterns and bounds: one table, checked against the CRD and the server.
MANAGED_FLAGS = admission.MANAGED_FLAGS
MANAGED_ENV = admission.MANAGED_ENV


class SpecError(ValueError):
    """A spec the operator cannot act on; ``str()`` names the field and the fix."""


def _err(path: str, message: str) -> SpecError:
    return SpecError(f"{path}: {message}")


def _obj(raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, Mapping):
        raise _err(f"{path}.{key}", f"must be an object (got {type(value).__name__})")
    return value


def _int(raw: Mapping[str, Any], key: str, path: str, default: int | None, lo: int, hi: int) -> Any:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _err(f"{path}.{key}", f"must be an integer (got {value!r})")
    if not lo <= value <= hi:
        raise _err(f"{path}.{key}", f"must be between {lo} and {hi} (got {value})")
    return value


def _bounded(raw: Mapping[str, Any], key: str, path: str, default: int | None) -> Any:
    """An integer setting whose limits are the server's (``admission.BOUNDS``)."""
    bound = admission.BOUNDS[f"{path}.{key}"]
    value = _int(raw, key, path, default, int(bound.lo or 0), int(bound.hi or 2**31 - 1))
    if value is not None and bound.choices is not None and value not in bound.choices:
        *head, last = (str(c) for c in bound.choices)
        raise _err(f"{path}.{key}", f"must be {', '.join(head)} or {last} (got {value})")
    return value


def _bool(raw: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise _err(f"{path}.{key}", f"must be true or false (got {value!r})")
    return value


def _str(raw: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str | None:
    value = raw.get(key, default)
    if value is not None and not isinstance(value, str):
        raise _err(f"{path}.{key}", f"must be a string (got {value!r})")
    return value


def _enum(
    raw: Mapping[str, Any], key: str, path: str, default: str, allowed: tuple[str, ...]
) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise _err(f"{path}.{key}", f"must be one of {', '.join(allowed)} (got {value!r})")
    return value


def _quantity(raw: Mapping[str, Any], key: str, path: str, default: str | None = None) -> Any:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _err(f"{path}.{key}", f"must be a quantity such as 4, 500m or 16Gi (got {value!r})")
    if isinstance(value, str) and not admission.matches(admission.QUANTITY_PATTERN, value):
        raise _err(f"{path}.{key}", f"must be a quantity such as 4, 500m or 16Gi (got {value!r})")
    return str(value)


def _secret_ref(
    raw: Mapping[str, Any], key: str, path: str, default_key: str | None = None
) -> SecretRef | None:
    ref = raw.get(key)
    if ref is None:
        return None
    if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str) or not ref["name"]:
        raise _err(f"{path}.{key}.name", "is required (the name of a Secret in this namespace)")
    if default_key is None:
        return SecretRef(name=ref["name"])
    return SecretRef(name=ref["name"], key=_str(ref, "key", f"{path}.{key}", default_key))


@dataclass(frozen=True)
class SecretRef:
    """A Secret in the LLMDeployment's namespace (``key`` where one key is read)."""

    name: str
    key: str | None = None


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: ``hf://org/name``, ``pvc://claim/path``, ``s3://bucket/prefix``
    or ``builtin://demo`` (the server's random-weight demo model, for CPU tests)."""

    source: str
    revision: str | None = None
    credentials: SecretRef | None = None

    @property
    def scheme(self) -> str:
        return self.source.split("://", 1)[0]

    @property
    def location(self) -> str:
        """Everything after ``scheme://``."""
        return self.source.split("://", 1)[1]

    @property
    def needs_download(self) -> bool:
        return self.scheme in ("hf", "s3")

    @property
    def pvc_claim(self) -> str:
        return self.location.split("/", 1)[0]

    @property
    def pvc_path(self) -> str:
        parts = self.location.split("/", 1)
        return parts[1].strip("/") if len(parts) > 1 else ""

    def default_name(self) -> str:
        """The served model name when none is given."""
        if self.scheme == "hf":
            return self.location
        if self.scheme == "builtin":
            return self.location
        parts = [p for p in self.location.split("/") if p]
        return parts[-1]


def _model_source(raw: Mapping[str, Any], path: str) -> ModelSource:
    source = raw.get("source")
    if not isinstance(source, str) or not admission.matches(admission.SOURCE_PATTERN, source):
        raise _err(
            f"{path}.source",
            "must be hf://org/name, pvc://claim/path, s3://bucket/prefix or builtin://demo, "
            "in ASCII letters, digits and . _ - (no '..' or hidden path segments, no spaces "
            f"or other characters) (got {source!r})",
        )
    revision = _str(raw, "revision", path)
    if revision is not None and not admission.matches(admission.REVISION_PATTERN, revision):
        raise _err(f"{path}.revision", f"must be a branch, tag or commit name (got {revision!r})")
    if revision is not None and not source.startswith("hf://"):
        raise _err(f"{path}.revision", "applies to hf:// sources only")
    creds = _secret_ref(raw, "credentialsSecretRef", path)
    if creds is not None and not source.startswith(("hf://", "s3://")):
        raise _err(f"{path}.credentialsSecretRef", "applies to hf:// and s3:// sources only")
    return ModelSource(source=source, revision=revision, credentials=creds)


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    served_model_name: str
    max_model_len: int | None = None
    dtype: str = "auto"
    cache_size: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    device: str = "cuda"
    tensor_parallel_size: int = 1
    quantization: str = "none"
    prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = None  # None: the server's default (by GPU size)
    gpu_memory_utilization: float = 0.9
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_queue_len: int | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class DraftResources:
    """The draft sidecar container's own resources (placement sidecar only)."""

    gpus: int = 1
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class SpeculativeSpec:
    """``spec.speculative``: what proposes the tokens the target verifies, and where.

    ``method`` draft: ``draft_model`` proposes, in a sidecar container (``placement``
    sidecar, over a Unix socket) or in the server process (inprocess). ``method`` ngram:
    prompt lookup in the server; no draft model, no placement. ``ngram_min``/``ngram_max``
    are None when the spec leaves them to the server's defaults (``NGRAM_DEFAULTS``).
    """

    method: str
    num_speculative_tokens: int = 4
    draft_model: ModelSource | None = None
    placement: str | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    disable_by_batch_size: int | None = None
    resources: DraftResources = field(default_factory=DraftResources)

    @property
    def sidecar(self) -> bool:
        """Whether the draft model runs in its own container of the pod."""
        return self.placement == "sidecar"


@dataclass(frozen=True)
class RouterSpec:
    """``spec.router``: ``kvscale route`` pods in front of the replicas (prefix-aware
    routing, holding requests while no replica is ready). When enabled, the
    LLMDeployment's Service selects the router pods."""

    enabled: bool = False
    replicas: int = 1
    policy: str = "prefix"
    cpu: str | None = None
    memory: str | None = None
    hold_timeout_seconds: int = 300  # a cold start (download + load) must fit in it
    hold_queue_size: int = 256


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``: targets and behaviour of the KV-cache / queue-depth autoscaler.

    ``None`` for ``interval_seconds`` / ``prometheus_url`` means the operator-wide default;
    ``None`` for ``max_metric_age_seconds`` means three intervals. ``min_replicas`` 0
    (scale to zero) needs the router, which holds the first request and whose held and
    last-request metrics drive 0 -> 1 and, after ``scale_to_zero_after_seconds`` without
    requests, 1 -> 0.
    """

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_cache_utilization_percent: int = 80
    target_queue_depth_per_replica: int = 8
    scale_up_stabilization_window_seconds: int = 0
    scale_down_stabilization_window_seconds: int = 300
    prometheus_url: str | None = None
    interval_seconds: int | None = None
    tolerance_percent: int = 10
    scale_up_limit_percent: int = 100
    max_metric_age_seconds: int | None = None
    scale_to_zero_after_seconds: int = 300


@dataclass(frozen=True)
class ResourcesSpec:
    gpu_type: str | None = None
    cpu: str | None = None
    memory: str | None = None
    shared_memory_size: str = "16Gi"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 8000
    annotations: Mapping[str, str] = field(default_factory=dict)
    api_key: SecretRef | None = None


@dataclass(frozen=True)
class LifecycleSpec:
    startup_timeout_seconds: int = 1800
    drain_timeout_seconds: int = 120
    pre_stop_delay_seconds: int = 10


@dataclass(frozen=True)
class LLMDeploymentSpec:
    """The whole typed spec. Build it with :func:`parse_spec`."""

    model: ModelSpec
    engine: EngineSpec
    speculative: SpeculativeSpec | None
    replicas: int
    autoscaling: AutoscalingSpec
    router: RouterSpec
    resources: ResourcesSpec
    service: ServiceSpec
    lifecycle: LifecycleSpec
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    env: tuple[Mapping[str, Any], ...] = ()

    @property
    def gpus_per_replica(self) -> int:
        """GPUs the server container asks for: the TP size, none on CPU."""
        return self.engine.tensor_parallel_size if self.engine.device == "cuda" else 0


def _parse_model(raw: Mapping[str, Any]) -> ModelSpec:
    path = "spec.model"
    if not raw:
        raise _err(path, "is required (at least spec.model.source)")
    source = _model_source(raw, path)
    name = _str(raw, "servedModelName", path) or source.default_name()
    return ModelSpec(
        source=source,
        served_model_name=name,
        max_model_len=_bounded(raw, "maxModelLen", path, None),
        dtype=_enum(raw, "dtype", path, "auto", DTYPES),
        cache_size=_quantity(raw, "cacheSize", path),
    )


def _parse_engine(raw: Mapping[str, Any]) -> EngineSpec:
    path = "spec.engine"
    tp = _bounded(raw, "tensorParallelSize", path, 1)
    gmu = raw.get("gpuMemoryUtilization", 0.9)
    lo, hi = admission.BOUNDS[f"{path}.gpuMemoryUtilization"].lo, 1.0
    if isinstance(gmu, bool) or not isinstance(gmu, int | float) or not lo <= gmu <= hi:
        raise _err(f"{path}.gpuMemoryUtilization", f"must be a number in [{lo}, 1] (got {gmu!r})")
    extra = raw.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise _err(f"{path}.extraArgs", "must be a list of strings")
    for arg in extra:
        if not admission.matches(admission.ARG_PATTERN, arg):
            raise _err(f"{path}.extraArgs", f"{arg!r} contains control characters")
        why = admission.smuggled_flag(arg)
        if why is not None:
            raise _err(f"{path}.extraArgs", why)
    why = server_flags.extra_args_error(extra)
    if why is not None:
        raise _err(f"{path}.extraArgs", why)
    max_num_seqs = _bounded(raw, "maxNumSeqs", path, None)
    max_batched = _bounded(raw, "maxNumBatchedTokens", path, None)
    if None not in (max_batched, max_num_seqs) and max_batched < max_num_seqs:
        raise _err(
            f"{path}.maxNumBatchedTokens",
            f"must be >= maxNumSeqs ({max_num_seqs}) so every running sequence can decode "
            f"(got {max_batched})",
        )
    return EngineSpec(
        device=_enum(raw, "device", path, "cuda", DEVICES),
        tensor_parallel_size=tp,
        quantization=_enum(raw, "quantization", path, "none", QUANTIZATIONS),
        prefix_caching=_bool(raw, "prefixCaching", path, True),
        kv_cache_dtype=_enum(raw, "kvCacheDtype", path, "auto", KV_CACHE_DTYPES),
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=float(gmu),
        block_size=_bounded(raw, "blockSize", path, None),
        max_num_batched_tokens=max_batched,
        max_queue_len=_bounded(raw, "maxQueueLen", path, None),
        extra_args=tuple(extra),
    )


def _present(raw: Mapping[str, Any], key: str) -> bool:
    """Whether the spec sets ``key`` (a null is no value, as the API server prunes it)."""
    return raw.get(key) is not None


def _forbid(raw: Mapping[str, Any], key: str, path: str, why: str) -> None:
    if _present(raw, key):
        raise _err(f"{path}.{key}", why)


def _ngram_bounds(raw: Mapping[str, Any], path: str) -> tuple[int | None, int | None]:
    """``spec.speculative.ngram``: min and max n, each 1..16, min <= max counting an unset
    one as the server's default (min 5 alone would meet the default max 4 at start)."""
    lo = _int(raw, "min", path, None, *NGRAM_RANGE)
    hi = _int(raw, "max", path, None, *NGRAM_RANGE)
    eff_lo = NGRAM_DEFAULTS[0] if lo is None else lo
    eff_hi = NGRAM_DEFAULTS[1] if hi is None else hi
    if eff_lo > eff_hi:
        message = f"min ({eff_lo}) must be <= max ({eff_hi})"
        if lo is None or hi is None:
            message += (
                f"; an unset min is {NGRAM_DEFAULTS[0]} and an unset max {NGRAM_DEFAULTS[1]} "
                "(the server's defaults): set both"
            )
        raise _err(path, message)
    return lo, hi


def _draft_resources(raw: Mapping[str, Any], path: str) -> DraftResources:
    return DraftResources(
        gpus=_int(raw, "gpus", path, 1, 0, 8),
        cpu=_quantity(raw, "cpu", path),
        memory=_quantity(raw, "memory", path),
    )


def _parse_speculative(raw: Mapping[str, Any] | None) -> SpeculativeSpec | None:
    """``spec.speculative`` with the CRD's default (4 tokens) and CEL rules."""
    if not raw:
        return None
    path = "spec.speculative"
    method = raw.get("method")
    if method is None:
        raise _err(
            f"{path}.method",
            "is required: draft (a draft model proposes the tokens) or ngram (prompt lookup, "
            "no second model)",
        )
    method = _enum(raw, "method", path, "", SPECULATIVE_METHODS)
    common = {
        "method": method,
        "num_speculative_tokens": _int(raw, "numSpeculativeTokens", path, 4, 1, 16),
        # above maxNumSeqs' own maximum it could never apply
        "disable_by_batch_size": _int(raw, "disableByBatchSize", path, None, 1, 65536),
    }
    if method == "ngram":
        only_draft = "applies to method draft only; method ngram drafts from the prompt and "
        _forbid(raw, "draftModel", path, only_draft + "output (remove it, or set method: draft)")
        _forbid(raw, "placement", path, only_draft + "output in the server process")
        _forbid(raw, "resources", path, "are the draft sidecar's; method ngram has no sidecar")
        lo, hi = _ngram_bounds(_obj(raw, "ngram", path), f"{path}.ngram")
        return SpeculativeSpec(**common, ngram_min=lo, ngram_max=hi)
    _forbid(raw, "ngram", path, "applies to method ngram only (method is draft)")
    draft = raw.get("draftModel")
    if not isinstance(draft, Mapping):
        raise _err(
            f"{path}.draftModel",
            "is required when method is draft (its source: hf://, pvc://, s3:// or builtin://demo)",
        )
    placement = _enum(raw, "placement", path, "sidecar", PLACEMENTS)
    if placement != "sidecar":
        _forbid(
            raw,
            "resources",
            path,
            f"are the draft sidecar's; with placement {placement} the draft shares the server "
            "container's GPUs (size spec.resources instead)",
        )
    return SpeculativeSpec(
        **common,
        draft_model=_model_source(draft, f"{path}.draftModel"),
        placement=placement,
        resources=_draft_resources(_obj(raw, "resources", path), f"{path}.resources"),
    )


def _parse_router(raw: Mapping[str, Any]) -> RouterSpec:
    path = "spec.router"
    res = _obj(raw, "resources", path)
    return RouterSpec(
        enabled=_bool(raw, "enabled", path, False),
        replicas=_int(raw, "replicas", path, 1, 1, 100),
        policy=_enum(raw, "policy", path, "prefix", ROUTER_POLICIES),
        cpu=_quantity(res, "cpu", f"{path}.resources"),
        memory=_quantity(res, "memory", f"{path}.resources"),
        hold_timeout_seconds=_int(raw, "holdTimeoutSeconds", path, 300, 1, 3600),
        hold_queue_size=_int(raw, "holdQueueSize", path, 256, 0, 100000),
    )


def _parse_autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    path = "spec.autoscaling"
    url = _str(raw, "prometheusUrl", path)
    if url is not None and not admission.matches(admission.URL_PATTERN, url):
        raise _err(f"{path}.prometheusUrl", f"must be an http(s) URL (got {url!r})")
    spec = AutoscalingSpec(
        enabled=_bool(raw, "enabled", path, False),
        min_replicas=_int(raw, "minReplicas", path, 1, 0, admission.MAX_REPLICAS),
        max_replicas=_int(raw, "maxReplicas", path, 4, 1, admission.MAX_REPLICAS),
        target_kv_cache_utilization_percent=_int(
            raw, "targetKVCacheUtilizationPercent", path, 80, 1, 100
        ),
        target_queue_depth_per_replica=_int(raw, "targetQueueDepthPerReplica", path, 8, 1, 10000),
        scale_up_stabilization_window_seconds=_int(
            raw, "scaleUpStabilizationWindowSeconds", path, 0, 0, 3600
        ),
        scale_down_stabilization_window_seconds=_int(
            raw, "scaleDownStabilizationWindowSeconds", path, 300, 0, 3600
        ),
        prometheus_url=url,
        interval_seconds=_int(raw, "intervalSeconds", path, None, 1, 3600),
        tolerance_percent=_int(raw, "tolerancePercent", path, 10, 0, 100),
        scale_up_limit_percent=_int(raw, "scaleUpLimitPercent", path, 100, 1, 1000),
        max_metric_age_seconds=_int(raw, "maxMetricAgeSeconds", path, None, 1, 3600),
        scale_to_zero_after_seconds=_int(raw, "scaleToZeroAfterSeconds", path, 300, 1, 86400),
    )
    if spec.min_replicas > spec.max_replicas:
        raise _err(
            path,
            f"minReplicas ({spec.min_replicas}) must be <= maxReplicas ({spec.max_replicas})",
        )
    return spec


def _parse_resources(raw: Mapping[str, Any]) -> ResourcesSpec:
    path = "spec.resources"
    selector = raw.get("nodeSelector") or {}
    if not isinstance(selector, Mapping) or not all(isinstance(v, str) for v in selector.values()):
        raise _err(f"{path}.nodeSelector", "must map label names to strings")
    tolerations = raw.get("tolerations") or []
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        raise _err(f"{path}.tolerations", "must be a list of tolerations")
    affinity = raw.get("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        raise _err(f"{path}.affinity", "must be an affinity object")
    return ResourcesSpec(
        gpu_type=_str(raw, "gpuType", path),
        cpu=_quantity(raw, "cpu", path),
        memory=_quantity(raw, "memory", path),
        shared_memory_size=_quantity(raw, "sharedMemorySize", path, "16Gi"),
        node_selector=dict(selector),
        tolerations=tuple(dict(t) for t in tolerations),
        affinity=dict(affinity) if affinity else None,
    )


def _parse_service(raw: Mapping[str, Any]) -> ServiceSpec:
    path = "spec.service"
    annotations = raw.get("annotations") or {}
    if not isinstance(annotations, Mapping):
        raise _err(f"{path}.annotations", "must map names to strings")
    return ServiceSpec(
        type=_enum(raw, "type", path, "ClusterIP", SERVICE_TYPES),
        port=_int(raw, "port", path, 8000, 1, 65535),
        annotations=dict(annotations),
        api_key=_secret_ref(raw, "apiKeySecretRef", path, default_key="api-key"),
    )


def _parse_lifecycle(raw: Mapping[str, Any]) -> LifecycleSpec:
    path = "spec.lifecycle"
    return LifecycleSpec(
        startup_timeout_seconds=_int(raw, "startupTimeoutSeconds", path, 1800, 30, 86400),
        drain_timeout_seconds=_bounded(raw, "drainTimeoutSeconds", path, 120),
        pre_stop_delay_seconds=_int(raw, "preStopDelaySeconds", path, 10, 0, 300),
    )


def parse_spec(raw: Mapping[str, Any] | None) -> LLMDeploymentSpec:
    """Parse and default ``spec``; raise :class:`SpecError` naming the bad field."""
    if not isinstance(raw, Mapping):
        raise _err("spec", "is required")
    image = _str(raw, "image", "spec")
    pull_secrets = raw.get("imagePullSecrets") or []
    if not isinstance(pull_secrets, list) or not all(
        isinstance(s, Mapping) and isinstance(s.get("name"), str) for s in pull_secrets
    ):
        raise _err("spec.imagePullSecrets", "must be a list of {name: secret}")
    env = raw.get("env") or []
    if not isinstance(env, list) or not all(
        isinstance(e, Mapping) and isinstance(e.get("name"), str) for e in env
    ):
        raise _err("spec.env", "must be a list of {name, value | valueFrom}")
    for e in env:
        if e["name"] in MANAGED_ENV:
            raise _err(
                "spec.env",
                f"{e['name']} is set by the operator (the last duplicate would win); "
                f"spec.env may not set {', '.join(MANAGED_ENV)}",
            )
    spec = LLMDeploymentSpec(
        model=_parse_model(_obj(raw, "model", "spec")),
        engine=_parse_engine(_obj(raw, "engine", "spec")),
        speculative=_parse_speculative(_obj(raw, "speculative", "spec")),
        replicas=_int(raw, "replicas", "spec", 1, 0, admission.MAX_REPLICAS),
        autoscaling=_parse_autoscaling(_obj(raw, "autoscaling", "spec")),
        router=_parse_router(_obj(raw, "router", "spec")),
        resources=_parse_resources(_obj(raw, "resources", "spec")),
        service=_parse_service(_obj(raw, "service", "spec")),
        lifecycle=_parse_lifecycle(_obj(raw, "lifecycle", "spec")),
        image=image or None,
        image_pull_policy=_enum(raw, "imagePullPolicy", "spec", "IfNotPresent", PULL_POLICIES),
        image_pull_secrets=tuple(s["name"] for s in pull_secrets),
        service_account_name=_str(raw, "serviceAccountName", "spec"),
        env=tuple(dict(e) for e in env),
    )
    if spec.autoscaling.min_replicas == 0 and not (
        spec.autoscaling.enabled and spec.router.enabled
    ):
        raise _err(
            "spec.autoscaling.minReplicas",
            "0 (scale to zero) needs spec.autoscaling.enabled and spec.router.enabled: the "
            "router holds the first request while a replica starts (got 0; set it to 1 or "
            "enable both)",
        )
    return spec


def desired_replicas(spec: LLMDeploymentSpec, status: Mapping[str, Any] | None = None) -> int:
    """Replicas the Deployment should run now.

    Without autoscaling: ``spec.replicas`` (what ``kubectl scale`` and an HPA write).
    With autoscaling: the autoscaler's ``status.desiredReplicas`` when it has decided,
    else ``spec.replicas``; either way clamped to [minReplicas, maxReplicas].
    """
    auto = spec.autoscaling
    if not auto.enabled:
        return spec.replicas
    decided = (status or {}).get("desiredReplicas") if (status or {}).get("lastScaleTime") else None
    wanted = decided if isinstance(decided, int) else spec.replicas
    return max(auto.min_replicas, min(auto.max_replicas, wanted))
