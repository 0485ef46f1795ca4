"""Rendering is pure: LLMDeployment -> Deployment, Service, PodDisruptionBudget."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvscale.cli import build_parser
from kvscale.operator import constants as c
from kvscale.operator import render
from kvscale.operator.config import OperatorConfig
from kvscale.operator.spec import parse_spec
from tests.operator.conftest import EXAMPLES, ROOT

CONFIG = OperatorConfig(server_image="registry.local/kvscale-server:1.2.3")
MakeLLMD = Callable[..., dict[str, Any]]


def _render(make_llmd: MakeLLMD, spec: dict[str, Any], replicas: int | None = None, **kw: Any):
    llmd = make_llmd(spec, **kw)
    typed = parse_spec(llmd["spec"])
    return (
        llmd,
        typed,
        render.render_all(llmd, typed, CONFIG, typed.replicas if replicas is None else replicas),
    )


def _pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return objs[0]["spec"]["template"]["spec"]


def _container(pod: dict[str, Any], name: str = "server") -> dict[str, Any]:
    return next(ctr for ctr in pod["containers"] if ctr["name"] == name)


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_single_gpu_hf_model(make_llmd: MakeLLMD) -> None:
    _, _, objs = _render(
        make_llmd, {"model": {"source": "hf://Qwen/Qwen2.5-1.5B", "maxModelLen": 4096}}
    )
    assert [o["kind"] for o in objs] == ["Deployment", "Service"]  # no PDB for one replica
    deploy = objs[0]
    pod = _pod(objs)
    server = _container(pod)
    assert server["image"] == CONFIG.server_image
    assert server["resources"]["limits"][c.GPU_RESOURCE] == "1"
    assert server["command"] == ["kvscale"] and server["args"][0] == "serve"
    args = server["args"]
    assert _flag(args, "--model") == "/models/model"
    assert _flag(args, "--served-model-name") == "Qwen/Qwen2.5-1.5B"
    assert _flag(args, "--max-model-len") == "4096" and _flag(args, "--device") == "cuda"
    for default in ("--tensor-parallel-size", "--quantization", "--no-enable-prefix-caching"):
        assert default not in args  # defaults are left to the server (prefix caching: on)
    # weights come from an init container into the shared cache volume
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["hf", "download", "Qwen/Qwen2.5-1.5B"]
    assert {"name": "model-cache", "mountPath": "/models"} in init["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} not in pod[
        "volumes"
    ]
    # ownership, labels, selector
    for obj in objs:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": c.API_VERSION, "kind": c.KIND, "name": "demo", "uid": "uid-demo",
            "controller": True, "blockOwnerDeletion": True,
        }  # fmt: skip
        assert obj["metadata"]["labels"][c.OWNER_LABEL] == "demo"
        assert obj["metadata"]["labels"][c.MANAGED_BY_LABEL] == c.MANAGER
        assert c.SPEC_HASH_ANNOTATION in obj["metadata"]["annotations"]
    assert deploy["spec"]["selector"] == {"matchLabels": {c.OWNER_LABEL: "demo"}}
    assert deploy["spec"]["template"]["metadata"]["labels"][c.OWNER_LABEL] == "demo"
    assert render.selector_string("demo") == f"{c.OWNER_LABEL}=demo"


def test_tensor_parallel_asks_for_tp_gpus_and_shared_memory(make_llmd: MakeLLMD) -> None:
    spec = {
        "model": {"source": "hf://a/b"},
        "engine": {"tensorParallelSize": 4},
        "resources": {"sharedMemorySize": "32Gi", "gpuType": "NVIDIA-H100-80GB-HBM3"},
    }
    _, _, objs = _render(make_llmd, spec)
    pod = _pod(objs)
    server = _container(pod)
    assert server["resources"]["requests"][c.GPU_RESOURCE] == "4"
    assert server["resources"]["limits"][c.GPU_RESOURCE] == "4"
    assert _flag(server["args"], "--tensor-parallel-size") == "4"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in server["volumeMounts"]
    assert pod["nodeSelector"] == {c.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}
    assert {"key": c.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def test_engine_flags_follow_the_spec(make_llmd: MakeLLMD) -> None:
    spec = {
        "model": {"source": "pvc://models/llama/8b", "dtype": "bfloat16"},
        "engine": {
            "quantization": "fp8",
            "kvCacheDtype": "fp8",
            "prefixCaching": False,
            "maxNumSeqs": 64,
            "gpuMemoryUtilization": 0.85,
            "maxNumBatchedTokens": 8192,
            "maxQueueLen": 100,
            "extraArgs": ["--seed", "7"],
        },
        "lifecycle": {"drainTimeoutSeconds": 45},
    }
    _, _, objs = _render(make_llmd, spec)
    pod = _pod(objs)
    args = _container(pod)["args"]
    assert _flag(args, "--quantization") == "fp8" and _flag(args, "--kv-cache-dtype") == "fp8"
    assert "--no-enable-prefix-caching" in args
    assert (
        _flag(args, "--max-num-seqs") == "64" and _flag(args, "--gpu-memory-utilization") == "0.85"
    )
    assert (
        _flag(args, "--max-num-batched-tokens") == "8192"
        and _flag(args, "--max-queue-len") == "100"
    )
    assert _flag(args, "--dtype") == "bfloat16" and _flag(args, "--drain-timeout") == "45"
    assert args[-2:] == ["--seed", "7"]
    # pvc:// is mounted read-only, no download
    assert "initContainers" not in pod
    assert _flag(args, "--model") == "/models/model-pvc/llama/8b"
    assert {
        "name": "model-pvc",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in pod["volumes"]


def test_cpu_demo_needs_no_gpu(make_llmd: MakeLLMD) -> None:
    _, _, objs = _render(
        make_llmd, {"model": {"source": "builtin://demo"}, "engine": {"device": "cpu"}}
    )
    pod = _pod(objs)
    server = _container(pod)
    assert c.GPU_RESOURCE not in str(server["resources"]) and "tolerations" not in pod
    assert _flag(server["args"], "--model") == "demo" and _flag(server["args"], "--device") == "cpu"
    assert "--gpu-memory-utilization" not in server["args"]


def test_cpu_tensor_parallel_renders_what_the_server_accepts(make_llmd: MakeLLMD) -> None:
    from kvscale.server.api.launcher import check_flags

    spec = {
        "model": {"source": "builtin://demo"},
        "engine": {"device": "cpu", "tensorParallelSize": 2},
    }
    _, _, objs = _render(make_llmd, spec)
    server = _container(_pod(objs))
    assert c.GPU_RESOURCE not in str(server["resources"])
    assert _flag(server["args"], "--tensor-parallel-size") == "2"
    cfg = check_flags(build_parser().parse_args(server["args"]))  # gloo ranks on the CPU
    assert (cfg.tensor_parallel_size, cfg.device) == (2, "cpu")


def test_probes_drain_and_security(make_llmd: MakeLLMD) -> None:
    spec = {
        "model": {"source": "hf://a/b"},
        "lifecycle": {
            "startupTimeoutSeconds": 3600,
            "drainTimeoutSeconds": 120,
            "preStopDelaySeconds": 10,
        },
    }
    _, _, objs = _render(make_llmd, spec)
    deploy, pod = objs[0], _pod(objs)
    server = _container(pod)
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # long model loads
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "10"]
    assert pod["terminationGracePeriodSeconds"] >= 10 + 120  # preStop + drain fit in the grace
    assert deploy["spec"]["progressDeadlineSeconds"] > 3600
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true"
        and annotations["prometheus.io/path"] == "/metrics"
    )
    assert annotations["prometheus.io/port"] == "8000"
    assert (
        pod["securityContext"]["runAsNonRoot"] is True
        and pod["securityContext"]["runAsUser"] == 1000
    )
    assert pod["automountServiceAccountToken"] is False
    for ctr in pod["containers"] + pod["initContainers"]:
        sc = ctr["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}


def test_credentials_come_from_the_secret_never_inline(make_llmd: MakeLLMD) -> None:
    spec = {
        "model": {"source": "s3://bucket/llama", "credentialsSecretRef": {"name": "s3-creds"}},
        "service": {"apiKeySecretRef": {"name": "api", "key": "token"}},
    }
    _, _, objs = _render(make_llmd, spec)
    pod = _pod(objs)
    (init,) = pod["initContainers"]
    assert init["image"] == CONFIG.s3_downloader_image
    assert init["command"][:4] == ["aws", "s3", "sync", "s3://bucket/llama"]
    assert init["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    server = _container(pod)
    key = next(e for e in server["env"] if e["name"] == "KVSCALE_API_KEY")
    assert key["valueFrom"] == {"secretKeyRef": {"name": "api", "key": "token"}}
    assert "--api-key" not in server["args"]  # the server reads $KVSCALE_API_KEY
    assert "value" not in key


SOCKET_MOUNT = {"name": "draft-socket", "mountPath": "/var/run/kvscale-draft"}


def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())["spec"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_consistent_pods(make_llmd: MakeLLMD, path: Path) -> None:
    """Every mount names a volume of the pod, every volume is used, names are unique."""
    _, _, objs = _render(make_llmd, yaml.safe_load(path.read_text())["spec"])
    pod = _pod(objs)
    containers = pod["containers"] + pod.get("initContainers", [])
    volumes = [v["name"] for v in pod["volumes"]]
    mounted = {m["name"] for ctr in containers for m in ctr["volumeMounts"]}
    assert len(set(volumes)) == len(volumes) and mounted == set(volumes)
    assert len({ctr["name"] for ctr in containers}) == len(containers)
    for ctr in containers:
        paths = [m["mountPath"] for m in ctr["volumeMounts"]]
        assert len(set(paths)) == len(paths), ctr["name"]


def test_speculative_example_runs_the_draft_in_a_sidecar(make_llmd: MakeLLMD) -> None:
    _, _, objs = _render(make_llmd, _example("llmdeployment-speculative.yaml"))
    pod = _pod(objs)
    assert [ctr["name"] for ctr in pod["containers"]] == ["server", "draft"]
    assert [ctr["name"] for ctr in pod["initContainers"]] == ["model-download", "draft-download"]
    assert pod["initContainers"][1]["command"][:5] == [
        "aws", "s3", "sync", "s3://my-models/llama-3.2-1b-instruct", "/models/draft",
    ]  # fmt: skip
    assert pod["initContainers"][1]["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}]
    assert {"name": "draft-socket", "emptyDir": {}} in pod["volumes"]
    server, draft = _container(pod), _container(pod, "draft")
    assert SOCKET_MOUNT in server["volumeMounts"] and SOCKET_MOUNT in draft["volumeMounts"]
    assert server["args"][server["args"].index("--speculative-method") :] == [
        "--speculative-method", "draft",
        "--num-speculative-tokens", "4",
        "--speculative-model", "unix:///var/run/kvscale-draft/draft.sock",
        "--speculative-placement", "sidecar",
        "--speculative-disable-by-batch-size", "64",
    ]  # fmt: skip
    assert server["resources"]["limits"][c.GPU_RESOURCE] == "4"
    # the sidecar: same image, the draft model behind the socket, sized like the target
    assert draft["image"] == server["image"] and draft["command"] == ["kvscale"]
    assert draft["args"] == [
        "serve-draft",
        "--model", "/models/draft",
        "--socket", "/var/run/kvscale-draft/draft.sock",
        "--device", "cuda",
        "--dtype", "auto",
    ]  # fmt: skip
    # no maxNumSeqs: target and draft at the server's default with speculation (256)
    assert "--max-num-seqs" not in server["args"]
    assert "ports" not in draft  # no TCP: a binary protocol on the Unix socket
    assert draft["resources"]["limits"] == {c.GPU_RESOURCE: "1", "memory": "16Gi"}
    socket_test = {"command": ["test", "-S", "/var/run/kvscale-draft/draft.sock"]}
    startup, ready = draft["startupProbe"], draft["readinessProbe"]
    assert startup["exec"] == socket_test and ready["exec"] == socket_test
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # the model load
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 60
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in (
        draft["volumeMounts"]
    )
    assert draft["securityContext"] == server["securityContext"]
    assert draft["env"] == [e for e in server["env"] if e["name"] != "KVSCALE_API_KEY"]


def test_sidecar_follows_the_target_and_its_own_resources(make_llmd: MakeLLMD) -> None:
    spec = {
        "model": {"source": "hf://org/big", "maxModelLen": 8192, "dtype": "bfloat16"},
        "engine": {"maxNumSeqs": 64},
        "speculative": {
            "method": "draft",
            "draftModel": {"source": "pvc://drafts/small"},
            "numSpeculativeTokens": 7,
            "resources": {"gpus": 0, "cpu": "2"},
        },
    }
    _, _, objs = _render(make_llmd, spec)
    pod = _pod(objs)
    server, draft = _container(pod), _container(pod, "draft")
    assert _flag(draft["args"], "--device") == "cpu"  # no GPU asked for the sidecar
    assert c.GPU_RESOURCE not in str(draft["resources"])
    assert draft["resources"] == {"requests": {"cpu": "2"}}
    assert _flag(draft["args"], "--dtype") == "bfloat16"
    assert _flag(draft["args"], "--max-num-seqs") == "64"
    assert _flag(draft["args"], "--max-model-len") == "8192"
    assert _flag(draft["args"], "--model") == "/models/draft-pvc/small"
    assert _flag(server["args"], "--num-speculative-tokens") == "7"
    # the draft's PVC is the sidecar's alone; the target's download is the server's
    draft_pvc = {"name": "draft-pvc", "mountPath": "/models/draft-pvc", "readOnly": True}
    assert draft_pvc in draft["volumeMounts"] and draft_pvc not in server["volumeMounts"]
    assert [m["name"] for m in draft["volumeMounts"]] == ["tmp", "draft-pvc", "draft-socket"]
    assert [ctr["name"] for ctr in pod["initContainers"]] == ["model-download"]
    # a CPU deployment's sidecar runs on the CPU whatever speculative.resources.gpus says
    on_cpu = {
        **spec,
        "engine": {"device": "cpu"},
        "speculative": {**spec["speculative"], "resources": {"gpus": 1}},
    }
    cpu_draft = _container(_pod(_render(make_llmd, on_cpu)[2]), "draft")
    assert _flag(cpu_draft["args"], "--device") == "cpu"
    assert c.GPU_RESOURCE not in str(cpu_draft["resources"])


@pytest.mark.parametrize(
    ("draft", "path", "init", "mount"),
    [
        (
            {"source": "hf://org/small"},
            "/models/draft",
            ["model-download", "draft-download"],
            {"name": "model-cache", "mountPath": "/models", "readOnly": True},
        ),
        (
            {"source": "pvc://drafts/a/b"},
            "/models/draft-pvc/a/b",
            ["model-download"],
            {"name": "draft-pvc", "mountPath": "/models/draft-pvc", "readOnly": True},
        ),
    ],
)
def test_inprocess_draft_shares_the_server_container(
    make_llmd: MakeLLMD, draft: dict[str, Any], path: str, init: list[str], mount: dict[str, Any]
) -> None:
    spec = {
        "model": {"source": "hf://org/big"},
        "engine": {"tensorParallelSize": 2},
        "speculative": {"method": "draft", "placement": "inprocess", "draftModel": draft},
    }
    _, _, objs = _render(make_llmd, spec)
    pod = _pod(objs)
    assert [ctr["name"] for ctr in pod["containers"]] == ["server"]  # no sidecar
    assert [ctr["name"] for ctr in pod["initContainers"]] == init
    assert "draft-socket" not in str(pod["volumes"])
    server = _container(pod)
    assert server["args"][server["args"].index("--speculative-method") :] == [
        "--speculative-method", "draft",
        "--num-speculative-tokens", "4",
        "--speculative-model", path,
        "--speculative-placement", "inprocess",
    ]  # fmt: skip
    assert server["resources"]["limits"][c.GPU_RESOURCE] == "2"  # the draft shares them
    assert mount in server["volumeMounts"]  # where the server reads the draft's weights


def test_ngram_example_has_no_draft_at_all(make_llmd: MakeLLMD) -> None:
    _, _, objs = _render(make_llmd, _example("llmdeployment-ngram.yaml"))
    pod = _pod(objs)
    assert [ctr["name"] for ctr in pod["containers"]] == ["server"]
    assert [ctr["name"] for ctr in pod["initContainers"]] == ["model-download"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp", "model-cache"]
    args = _container(pod)["args"]
    assert args[args.index("--speculative-method") :] == [
        "--speculative-method", "ngram",
        "--num-speculative-tokens", "4",
        "--ngram-min", "2",
        "--ngram-max", "5",
        "--speculative-disable-by-batch-size", "32",
    ]  # fmt: skip


def test_ngram_sizes_are_left_to_the_server_unless_set(make_llmd: MakeLLMD) -> None:
    spec = {"model": {"source": "hf://a/b"}, "speculative": {"method": "ngram"}}
    args = _container(_pod(_render(make_llmd, spec)[2]))["args"]
    assert args[args.index("--speculative-method") :] == [
        "--speculative-method", "ngram", "--num-speculative-tokens", "4",
    ]  # fmt: skip
    spec["speculative"]["ngram"] = {"max": 3}
    args = _container(_pod(_render(make_llmd, spec)[2]))["args"]
    assert _flag(args, "--ngram-max") == "3" and "--ngram-min" not in args
    plain = _container(_pod(_render(make_llmd, {"model": {"source": "hf://a/b"}})[2]))["args"]
    assert not [a for a in plain if "specul" in a or "ngram" in a]


def test_extra_args_follow_the_speculative_flags(make_llmd: MakeLLMD) -> None:
    spec = {
        "model": {"source": "hf://a/b"},
        "engine": {"extraArgs": ["--seed", "7"]},
        "speculative": {"method": "ngram"},
    }
    args = _container(_pod(_render(make_llmd, spec)[2]))["args"]
    assert args[-2:] == ["--seed", "7"] and "--speculative-method" in args


def test_service_and_pdb(make_llmd: MakeLLMD) -> None:
    spec = {
        "model": {"source": "hf://a/b"},
        "replicas": 3,
        "service": {"type": "LoadBalancer", "port": 80, "annotations": {"x": "y"}},
    }
    _, _, objs = _render(make_llmd, spec)
    deploy, svc, pdb = objs
    assert deploy["spec"]["replicas"] == 3
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"]["x"] == "y"
    assert svc["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    assert svc["spec"]["selector"] == {c.OWNER_LABEL: "demo"}
    assert pdb["kind"] == "PodDisruptionBudget" and pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"] == {"matchLabels": {c.OWNER_LABEL: "demo"}}
    autoscaled = {
        "model": {"source": "hf://a/b"},
        "autoscaling": {"enabled": True, "maxReplicas": 3},
    }
    assert len(_render(make_llmd, autoscaled)[2]) == 3  # may grow past one replica


def test_hash_is_stable_ignores_replicas_and_changes_with_the_template(make_llmd: MakeLLMD) -> None:
    spec = {"model": {"source": "hf://a/b"}, "replicas": 2}
    _, _, one = _render(make_llmd, spec)
    _, _, again = _render(make_llmd, spec, replicas=5)
    key = c.SPEC_HASH_ANNOTATION
    assert one[0]["metadata"]["annotations"][key] == again[0]["metadata"]["annotations"][key]
    _, _, changed = _render(make_llmd, {**spec, "engine": {"prefixCaching": False}})
    assert one[0]["metadata"]["annotations"][key] != changed[0]["metadata"]["annotations"][key]
    assert one[1]["metadata"]["annotations"][key] == changed[1]["metadata"]["annotations"][key]


@pytest.mark.parametrize(
    "spec",
    [
        {
            "model": {"source": "builtin://demo", "maxModelLen": 512},
            "engine": {"device": "cpu", "blockSize": 16},
        },
        {
            "model": {"source": "hf://a/b"},
            "engine": {
                "tensorParallelSize": 2,
                "quantization": "fp8",
                "kvCacheDtype": "fp8",
                "prefixCaching": False,
            },
        },
    ],
)
def test_rendered_command_lines_parse_with_the_cli(
    make_llmd: MakeLLMD, spec: dict[str, Any]
) -> None:
    """Every flag the operator renders exists in `kvscale serve` (kvscale.cli.build_parser).
    Speculative command lines: test_admission.test_speculative_command_lines_parse."""
    _, _, objs = _render(make_llmd, spec)
    for ctr in _pod(objs)["containers"]:
        assert ctr["command"] == ["kvscale"]
        args = build_parser().parse_args(ctr["args"])
        assert args.command == "serve"


@pytest.mark.parametrize("quantization", ["awq", "gptq"])
@pytest.mark.parametrize(("device", "dtype"), [("cpu", "float32"), ("cuda", "bfloat16")])
def test_4bit_quantization_renders_flags_the_server_accepts(
    make_llmd: MakeLLMD, quantization: str, device: str, dtype: str
) -> None:
    """awq/gptq are admitted on either device and any dtype (the W4A16 GEMM runs fp16,
    bf16 and fp32 activations; its torch reference is the CPU path), and the server's
    own flag check takes what the operator renders."""
    from kvscale.server.api.launcher import check_flags

    spec = {
        "model": {"source": "hf://a/b", "dtype": dtype},
        "engine": {"device": device, "quantization": quantization},
    }
    _, _, objs = _render(make_llmd, spec)
    args = build_parser().parse_args(_container(_pod(objs))["args"])
    cfg = check_flags(args)
    assert cfg.quantization == quantization and cfg.dtype == dtype and cfg.device == device


# --- spec.router -------------------------------------------------------------------------


ROUTED = {
    "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct"},
    "router": {"enabled": True, "replicas": 2, "resources": {"cpu": "1", "memory": "2Gi"}},
    "engine": {"blockSize": 32},
    "service": {"apiKeySecretRef": {"name": "keys"}},
}


def _by_kind(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_router_objects_and_the_service_that_selects_them(make_llmd: MakeLLMD) -> None:
    llmd, _, objs = _render(make_llmd, ROUTED)
    name, ns = llmd["metadata"]["name"], llmd["metadata"]["namespace"]
    got = _by_kind(objs)
    # the RBAC and the router before the Service that sends traffic to its pods
    assert [o["kind"] for o in objs] == [
        "Deployment", "ServiceAccount", "Role", "RoleBinding", "Service", "Deployment", "Service",
    ]  # fmt: skip
    router = got[("Deployment", f"{name}-router")]
    server = got[("Deployment", name)]
    # disjoint selectors: the server Deployment (and the autoscaler's pod list, the
    # child indexes) never see router pods, and the other way round
    rsel = router["spec"]["selector"]["matchLabels"]
    ssel = server["spec"]["selector"]["matchLabels"]
    rpod_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not set(ssel.items()) <= set(rpod_labels.items())
    assert not set(rsel.items()) <= set(server["spec"]["template"]["metadata"]["labels"].items())
    assert c.OWNER_LABEL not in router["metadata"]["labels"]
    assert got[("Service", name)]["spec"]["selector"] == rsel
    headless = got[("Service", f"{name}-replicas")]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == ssel
    assert headless["spec"]["ports"][0]["targetPort"] == "http"
    # the router's command line: the replicas from the headless Service's EndpointSlices
    pod = router["spec"]["template"]["spec"]
    ctr = _container(pod, "router")
    args = ctr["args"]
    assert args[0] == "route" and _flag(args, "--endpoint-slices") == f"{ns}/{name}-replicas"
    assert _flag(args, "--endpoint-port") == "http" and _flag(args, "--policy") == "prefix"
    assert _flag(args, "--block-size") == "32"  # hashes blocks as the servers do
    assert _flag(args, "--tokenizer") == "/tokenizer" and _flag(args, "--hold-timeout") == "300"
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["hf", "download", "Qwen/Qwen2.5-7B-Instruct"]
    assert "tokenizer.json" in init["command"] and "*.safetensors" not in init["command"]
    assert pod["serviceAccountName"] == f"{name}-router"
    assert pod["automountServiceAccountToken"] is True
    assert ctr["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"memory": "2Gi"},
    }
    env = {e["name"]: e for e in ctr["env"]}
    assert env["KVSCALE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-key"}
    assert router["spec"]["replicas"] == 2
    notes = router["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/port"] == str(c.ROUTER_PORT)  # the autoscaler reads it
    # the router parses its own command line
    parsed = build_parser().parse_args(args)
    assert parsed.endpoint_slices == f"{ns}/{name}-replicas" and parsed.port == c.ROUTER_PORT
    # least privilege: read EndpointSlices and pods, in the namespace only
    role = got[("Role", f"{name}-router")]
    assert role["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]  # fmt: skip
    binding = got[("RoleBinding", f"{name}-router")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{name}-router", "namespace": ns}
    ]
    for obj in objs:
        assert obj["metadata"]["ownerReferences"][0]["uid"] == llmd["metadata"]["uid"]


@pytest.mark.parametrize(
    ("source", "policy", "tokenizer", "init"),
    [
        ("pvc://models/qwen-7b", "prefix", "/tokenizer-pvc/qwen-7b", []),
        ("s3://bucket/qwen", "prefix", "/tokenizer", ["tokenizer-download"]),
        ("builtin://demo", "prefix", None, []),  # token-id prompts only
        ("hf://a/b", "least-loaded", None, []),  # no prefix: no tokenizer to fetch
    ],
)
def test_router_tokenizer_sources(
    make_llmd: MakeLLMD, source: str, policy: str, tokenizer: str | None, init: list[str]
) -> None:
    spec = {"model": {"source": source}, "router": {"enabled": True, "policy": policy}}
    llmd, _, objs = _render(make_llmd, spec)
    router = _by_kind(objs)[("Deployment", f"{llmd['metadata']['name']}-router")]
    pod = router["spec"]["template"]["spec"]
    assert _flag(_container(pod, "router")["args"], "--tokenizer") == tokenizer
    assert [ctr["name"] for ctr in pod.get("initContainers", [])] == init
    if source.startswith("pvc"):
        (claim,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claim["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}


def test_no_router_objects_when_disabled(make_llmd: MakeLLMD) -> None:
    llmd, _, objs = _render(make_llmd, {"model": {"source": "hf://a/b"}})
    assert [o["kind"] for o in objs] == ["Deployment", "Service"]
    assert objs[1]["spec"]["selector"] == {c.OWNER_LABEL: llmd["metadata"]["name"]}
