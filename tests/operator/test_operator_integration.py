"""The real operator (``kopf run``) against the API emulator, driven with a real ``kubectl``.

One emulated cluster and one operator for the module; the tests run in order and build on
each other like a person using the cluster would. No controllers run in the emulator: the
tests set Deployment status and create pods themselves to play the kubelet and scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from kvscale.operator import constants as c
from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.conftest import ROOT
from tests.operator.harness import (
    Cluster,
    Operator,
    emulated_cluster,
    granted_permissions,
    used_permissions,
    wait_for,
)

NS = "ml"
APPS = "apps/v1"
LLMD_API = "serving.kvscale.dev/v1alpha1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("operator")
    with EmulatorThread() as emu:
        kubeconfig, kubectl = emulated_cluster(emu, workdir, NS)
        operator = Operator(kubeconfig, workdir)
        operator.start()
        try:
            yield Cluster(emu, kubectl, operator)
        except BaseException:
            print(operator.tail())
            raise
        finally:
            operator.stop()


def _deployment(cluster: Cluster, name: str) -> dict[str, Any] | None:
    return cluster.get(APPS, "deployments", NS, name)


def _args(deployment: dict[str, Any]) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def _mark_ready(cluster: Cluster, name: str) -> None:
    """Play the Deployment controller: all replicas of the current generation are ready."""
    dep = _deployment(cluster, name)
    assert dep is not None
    n = dep["spec"]["replicas"]
    cluster.emu.set_status(
        APPS,
        "deployments",
        NS,
        name,
        {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": n,
            "updatedReplicas": n,
            "readyReplicas": n,
            "availableReplicas": n,
            "conditions": [
                {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}
            ],
        },
    )


def test_examples_apply_and_reconcile(cluster: Cluster) -> None:
    out = cluster.kubectl("apply", "-f", str(ROOT / "examples"))
    assert out.count("created") == 6
    dep = wait_for(lambda: _deployment(cluster, "qwen"), what="the qwen Deployment")
    assert (
        dep["metadata"]["ownerReferences"][0]["uid"] == cluster.llmd(NS, "qwen")["metadata"]["uid"]
    )
    server = dep["spec"]["template"]["spec"]["containers"][0]
    assert server["resources"]["limits"][c.GPU_RESOURCE] == "1"
    assert server["image"] == "kvscale-server:test"
    # the reconcile pass writes the Deployment before the Service: wait for it too
    wait_for(lambda: cluster.get("v1", "services", NS, "qwen"), what="the qwen Service")
    assert cluster.get("policy/v1", "poddisruptionbudgets", NS, "qwen") is None  # one replica
    fp8 = wait_for(lambda: _deployment(cluster, "llama-8b-fp8"), what="the FP8 Deployment")
    assert {"--quantization", "--kv-cache-dtype"} <= set(_args(fp8))
    assert "--no-enable-prefix-caching" not in _args(fp8)  # on: the server's default
    # n-gram speculation: flags on the server, no sidecar, no second download
    ngram = wait_for(lambda: _deployment(cluster, "qwen-coder-ngram"), what="the n-gram one")
    assert [ctr["name"] for ctr in ngram["spec"]["template"]["spec"]["containers"]] == ["server"]
    assert [ctr["name"] for ctr in ngram["spec"]["template"]["spec"]["initContainers"]] == [
        "model-download"
    ]
    args = _args(ngram)
    assert args[args.index("--speculative-method") + 1] == "ngram"
    assert "--speculative-model" not in args
    status = wait_for(
        lambda: (
            (cluster.llmd(NS, "qwen") or {}).get("status", {}).get("endpoint")
            and cluster.llmd(NS, "qwen")["status"]
        )
    )
    assert status["endpoint"] == "http://qwen.ml.svc.cluster.local:8000"
    assert status["selector"] == f"{c.OWNER_LABEL}=qwen" and status["desiredReplicas"] == 1
    wait_for(  # events are posted after the pass that wrote the status
        lambda: "Created" in {e["reason"] for e in cluster.events(NS, "qwen")}, what="events"
    )


def test_printer_columns(cluster: Cluster) -> None:
    table = cluster.kubectl("get", "llmd")
    header, *rows = table.splitlines()
    assert header.split() == ["NAME", "MODEL", "TP", "READY", "DESIRED", "KV%", "STATUS", "AGE"]
    qwen = next(row.split() for row in rows if row.startswith("qwen "))
    assert qwen[1:5] == ["hf://Qwen/Qwen2.5-1.5B-Instruct", "1", "0", "1"]
    assert qwen[5] == "ReplicasNotReady"  # KV% is empty until the autoscaler reports
    header, *rows = cluster.kubectl("get", "llmd", "-o", "wide").splitlines()
    assert "SPECULATIVE" in header.split()
    methods = {row.split()[0]: row.split() for row in rows}
    assert "ngram" in methods["qwen-coder-ngram"] and "draft" in methods["llama-70b-spec"]
    assert not {"ngram", "draft"} & set(methods["qwen"])


def test_missing_secret_is_degraded_then_recovers(cluster: Cluster) -> None:
    degraded = wait_for(
        lambda: (
            cluster.condition(NS, "llama-8b-tp2", c.DEGRADED).get("status") == "True"
            and cluster.condition(NS, "llama-8b-tp2", c.DEGRADED)
        )
    )
    assert degraded["reason"] == "SecretNotFound"
    assert (
        "Secret ml/hf-token (from spec.model.credentialsSecretRef) does not exist"
        in degraded["message"]
    )
    assert (
        "kubectl -n ml create secret generic hf-token --from-literal=HF_TOKEN=..."
        in degraded["message"]
    )
    assert _deployment(cluster, "llama-8b-tp2") is None  # no pods that would fail to start
    warning = wait_for(
        lambda: [e for e in cluster.events(NS, "llama-8b-tp2") if e["reason"] == "SecretNotFound"]
    )
    assert warning[0]["type"] == "Warning"
    spec_degraded = wait_for(
        lambda: (
            cluster.condition(NS, "llama-70b-spec", c.DEGRADED).get("status") == "True"
            and cluster.condition(NS, "llama-70b-spec", c.DEGRADED)
        )
    )
    assert spec_degraded["reason"] == "SecretNotFound", spec_degraded
    assert "Secret ml/s3-credentials" in spec_degraded["message"]
    assert _deployment(cluster, "llama-70b-spec") is None

    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "hf-token"},
                "stringData": {"HF_TOKEN": "hf_test"},
            }
        ),
    )
    dep = wait_for(lambda: _deployment(cluster, "llama-8b-tp2"), what="the TP=2 Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"][c.GPU_RESOURCE] == "2"
    assert "--tensor-parallel-size" in _args(dep)
    assert any(v["name"] == "dshm" for v in pod["volumes"])
    assert pod["initContainers"][0]["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert "hf_test" not in str(dep)
    wait_for(  # written after the Deployment and the Service in the same pass
        lambda: cluster.get("policy/v1", "poddisruptionbudgets", NS, "llama-8b-tp2"), what="a PDB"
    )
    wait_for(lambda: cluster.condition(NS, "llama-8b-tp2", c.DEGRADED).get("status") == "False")
    wait_for(lambda: any(e["reason"] == "Recovered" for e in cluster.events(NS, "llama-8b-tp2")))

    # A Secret without the keys the download reads is caught too.
    s3 = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3-credentials"},
        "stringData": {"AWS_ACCESS_KEY_ID": "a"},
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(s3))
    cond = wait_for(
        lambda: (
            cluster.condition(NS, "llama-70b-spec", c.DEGRADED).get("reason") == "SecretKeyMissing"
            and cluster.condition(NS, "llama-70b-spec", c.DEGRADED)
        )
    )
    assert "has no key AWS_SECRET_ACCESS_KEY" in cond["message"]
    s3["stringData"]["AWS_SECRET_ACCESS_KEY"] = "b"
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(s3))
    # Speculative decoding with a draft model in a sidecar: the pods come once the
    # Secret is complete (no refusal of spec.speculative any more).
    spec_dep = wait_for(
        lambda: _deployment(cluster, "llama-70b-spec"), what="the speculative Deployment"
    )
    pod = spec_dep["spec"]["template"]["spec"]
    assert [ctr["name"] for ctr in pod["containers"]] == ["server", "draft"]
    assert [ctr["name"] for ctr in pod["initContainers"]] == ["model-download", "draft-download"]
    assert {"name": "draft-socket", "emptyDir": {}} in pod["volumes"]
    assert pod["containers"][1]["args"][0] == "serve-draft"
    args = _args(spec_dep)
    assert args[args.index("--speculative-model") + 1] == "unix:///var/run/kvscale-draft/draft.sock"
    wait_for(
        lambda: cluster.condition(NS, "llama-70b-spec", c.DEGRADED).get("status") == "False",
        what="the speculative LLMDeployment no longer degraded",
    )
    assert not any(e["reason"] == "NotSupported" for e in cluster.events(NS, "llama-70b-spec"))


ROUTED = "qwen-routed"  # examples/llmdeployment-router-scale-to-zero.yaml
ROUTER_OBJECTS = [
    ("v1", "serviceaccounts", f"{ROUTED}-router"),
    ("rbac.authorization.k8s.io/v1", "roles", f"{ROUTED}-router"),
    ("rbac.authorization.k8s.io/v1", "rolebindings", f"{ROUTED}-router"),
    ("v1", "services", f"{ROUTED}-replicas"),
    (APPS, "deployments", f"{ROUTED}-router"),
]


def test_the_router_is_rendered_and_removed_when_disabled(cluster: Cluster) -> None:
    for api, plural, name in ROUTER_OBJECTS:
        wait_for(lambda a=api, p=plural, n=name: cluster.get(a, p, NS, n), what=f"{plural} {name}")
    router = cluster.get(APPS, "deployments", NS, f"{ROUTED}-router")
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{ROUTED}-router"
    args = pod["containers"][0]["args"]
    assert args[args.index("--endpoint-slices") + 1] == f"{NS}/{ROUTED}-replicas"
    assert args[args.index("--tokenizer") + 1] == "/tokenizer"
    assert [ctr["name"] for ctr in pod["initContainers"]] == ["tokenizer-download"]
    assert router["spec"]["replicas"] == 2
    # the Service selects the router pods; the headless one the servers, for the router
    svc = wait_for(lambda: cluster.get("v1", "services", NS, ROUTED), what="the Service")
    assert svc["spec"]["selector"] == {c.ROUTER_LABEL: ROUTED}
    replicas = cluster.get("v1", "services", NS, f"{ROUTED}-replicas")
    assert replicas["spec"]["selector"] == {c.OWNER_LABEL: ROUTED}
    assert replicas["spec"]["clusterIP"] == "None"
    role = cluster.get("rbac.authorization.k8s.io/v1", "roles", NS, f"{ROUTED}-router")
    assert {(r["apiGroups"][0], r["resources"][0]) for r in role["rules"]} == {
        ("discovery.k8s.io", "endpointslices"),
        ("", "pods"),
    }
    # the server Deployment is still the one the status and the pods' selector follow
    assert cluster.llmd(NS, ROUTED)["status"]["selector"] == f"{c.OWNER_LABEL}={ROUTED}"

    # a server pod's event is answered from the indexes: the watched router Deployment is
    # as rendered, so its RBAC objects and Service are not read again
    def router_reads() -> int:
        kinds = ("serviceaccounts", "roles", "rolebindings")
        return sum(
            1
            for r in cluster.operator_requests()
            if r.method.value == "GET" and r.resource is not None and r.resource.plural in kinds
        )

    cluster.quiet()
    before = router_reads()
    pod = f"{ROUTED}-abc12"
    cluster.emu.create(
        "v1",
        "pods",
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod,
                "namespace": NS,
                "labels": {c.OWNER_LABEL: ROUTED, c.MANAGED_BY_LABEL: c.MANAGER},
            },
            "spec": {"containers": [{"name": "server", "image": "kvscale-server:test"}]},
        },
    )
    unschedulable = {
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
    }  # fmt: skip
    cluster.emu.set_status(
        "v1", "pods", NS, pod, {"phase": "Pending", "conditions": [unschedulable]}
    )
    wait_for(lambda: cluster.condition(NS, ROUTED, c.DEGRADED).get("reason") == "Unschedulable")
    assert router_reads() == before
    cluster.emu.delete("v1", "pods", NS, pod)

    patch = '{"spec": {"router": {"enabled": false}, "autoscaling": {"minReplicas": 1}}}'
    cluster.kubectl("patch", "llmd", ROUTED, "--type=merge", "-p", patch)
    for api, plural, name in ROUTER_OBJECTS:
        wait_for(
            lambda a=api, p=plural, n=name: cluster.get(a, p, NS, n) is None,
            what=f"{plural} {name} deleted",
        )
    wait_for(
        lambda: (
            cluster.get("v1", "services", NS, ROUTED)["spec"]["selector"] == {c.OWNER_LABEL: ROUTED}
        ),
        what="the Service over the servers again",
    )
    wait_for(lambda: any(e["reason"] == "Deleted" for e in cluster.events(NS, ROUTED)))
    cluster.kubectl("delete", "llmd", ROUTED, "--timeout=20s")


def test_ready_when_the_pods_are(cluster: Cluster) -> None:
    _mark_ready(cluster, "qwen")
    cluster.kubectl("wait", "--for=condition=Ready", "llmd/qwen", "--timeout=20s")
    status = cluster.llmd(NS, "qwen")["status"]
    assert status["readyReplicas"] == 1 and status["observedGeneration"] == 1
    assert cluster.condition(NS, "qwen", c.PROGRESSING)["reason"] == "RolloutComplete"
    assert "AllReplicasReady" in cluster.kubectl("get", "llmd", "qwen")
    wait_for(lambda: any(e["reason"] == "Ready" for e in cluster.events(NS, "qwen")))


def _writes(cluster: Cluster) -> list[tuple[str, str]]:
    return [
        (r.method.value, r.url.path)
        for r in cluster.operator_requests()
        if r.method.value in ("POST", "PUT", "PATCH", "DELETE")
        and r.resource is not None
        and r.resource.plural != "events"
    ]


def test_nothing_is_written_again_after_a_restart(cluster: Cluster) -> None:
    cluster.quiet()
    before = len(_writes(cluster))
    cluster.operator.stop()
    cluster.operator.start()
    wait_for(
        lambda: cluster.operator.log.read_text().count("Resuming is processed") >= 4,
        what="resume handlers",
    )
    cluster.quiet()
    assert _writes(cluster)[before:] == []
    assert cluster.condition(NS, "qwen", c.READY)["status"] == "True"


def test_a_spec_change_rolls_the_pods(cluster: Cluster) -> None:
    old = _deployment(cluster, "qwen")
    old_svc = cluster.get("v1", "services", NS, "qwen")
    patch = '{"spec":{"engine":{"prefixCaching":false},"service":{"annotations":{"team":"ml"}}}}'
    cluster.kubectl("patch", "llmd", "qwen", "--type=merge", "-p", patch)
    new = wait_for(
        lambda: (
            "--no-enable-prefix-caching" in _args(_deployment(cluster, "qwen"))
            and _deployment(cluster, "qwen")
        )
    )
    svc = wait_for(
        lambda: (
            cluster.get("v1", "services", NS, "qwen")["metadata"]["annotations"].get("team")
            and cluster.get("v1", "services", NS, "qwen")
        )
    )
    assert (
        svc["spec"]["clusterIP"] == old_svc["spec"]["clusterIP"]
    )  # allocated fields survive updates
    assert new["metadata"]["generation"] == old["metadata"]["generation"] + 1
    hash_key = c.SPEC_HASH_ANNOTATION
    assert new["metadata"]["annotations"][hash_key] != old["metadata"]["annotations"][hash_key]
    assert new["spec"]["template"] != old["spec"]["template"]
    status = wait_for(
        lambda: (
            cluster.llmd(NS, "qwen")["status"].get("observedGeneration") == 2
            and cluster.llmd(NS, "qwen")["status"]
        )
    )
    conds = {cond["type"]: cond for cond in status["conditions"]}
    assert conds[c.PROGRESSING]["status"] == "True" and conds[c.READY]["status"] == "False"
    wait_for(lambda: any(e["reason"] == "Updated" for e in cluster.events(NS, "qwen")))
    _mark_ready(cluster, "qwen")
    wait_for(lambda: cluster.condition(NS, "qwen", c.READY).get("status") == "True")


def test_kubectl_scale_and_the_disruption_budget(cluster: Cluster) -> None:
    template = _deployment(cluster, "qwen")["spec"]["template"]
    cluster.kubectl("scale", "llmd", "qwen", "--replicas=3")
    wait_for(lambda: _deployment(cluster, "qwen")["spec"]["replicas"] == 3, what="3 replicas")
    assert _deployment(cluster, "qwen")["spec"]["template"] == template  # scaling does not roll
    wait_for(lambda: cluster.get("policy/v1", "poddisruptionbudgets", NS, "qwen"), what="a PDB")
    assert wait_for(lambda: cluster.llmd(NS, "qwen")["status"]["desiredReplicas"] == 3)
    wait_for(lambda: any(e["reason"] == "Scaled" for e in cluster.events(NS, "qwen")))
    cluster.kubectl("scale", "llmd", "qwen", "--replicas=1")
    wait_for(
        lambda: cluster.get("policy/v1", "poddisruptionbudgets", NS, "qwen") is None, what="no PDB"
    )
    assert _deployment(cluster, "qwen")["spec"]["replicas"] == 1
    _mark_ready(cluster, "qwen")


def test_unschedulable_pods_degrade_with_an_actionable_message(cluster: Cluster) -> None:
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "qwen-abc12",
                    "labels": {c.OWNER_LABEL: "qwen", c.MANAGED_BY_LABEL: c.MANAGER},
                },
                "spec": {"containers": [{"name": "server", "image": "kvscale-server:test"}]},
            }
        ),
    )
    cluster.emu.set_status(
        "v1",
        "pods",
        NS,
        "qwen-abc12",
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                }
            ],
        },
    )
    cond = wait_for(
        lambda: (
            cluster.condition(NS, "qwen", c.DEGRADED).get("reason") == "Unschedulable"
            and cluster.condition(NS, "qwen", c.DEGRADED)
        )
    )
    assert (
        "4 Insufficient nvidia.com/gpu" in cond["message"] and "1 nvidia.com/gpu" in cond["message"]
    )
    assert "tensorParallelSize" in cond["message"]
    described = cluster.kubectl("describe", "llmd", "qwen")
    assert "Unschedulable" in described
    cluster.kubectl("delete", "pod", "qwen-abc12")
    wait_for(lambda: cluster.condition(NS, "qwen", c.DEGRADED).get("status") == "False")


def test_invalid_specs_are_refused_by_the_api(cluster: Cluster) -> None:
    bad = {
        "apiVersion": LLMD_API,
        "kind": "LLMDeployment",
        "metadata": {"name": "bad"},
        "spec": {
            "model": {"source": "hf://a/b"},
            "engine": {"tensorParallelSize": 3},
            "autoscaling": {"minReplicas": 4, "maxReplicas": 2},
        },
    }
    proc = cluster.kubectl.run("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert proc.returncode != 0
    assert "tensorParallelSize must be a power of two up to 8" in proc.stderr
    assert "minReplicas must be less than or equal to autoscaling.maxReplicas" in proc.stderr
    typo = {**bad, "spec": {"model": {"source": "hf://a/b"}, "replica": 2}}
    proc = cluster.kubectl.run("apply", "-f", "-", input=yaml.safe_dump(typo), check=False)
    assert proc.returncode != 0 and 'unknown field "spec.replica"' in proc.stderr
    assert cluster.llmd(NS, "bad") is None


def test_api_failures_become_degraded_and_are_retried(cluster: Cluster) -> None:
    emu: EmulatorThread = cluster.emu
    # A kmock reaction answers the first POST of this Service with a 500, then lets it pass.
    flaky = kmock.data({"metadata": {"name": "flaky"}})
    emu.call(lambda: emu.api[f"post /api/v1/namespaces/{NS}/services"][flaky][:1] << 500)
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {
                "apiVersion": LLMD_API,
                "kind": "LLMDeployment",
                "metadata": {"name": "flaky"},
                "spec": {"model": {"source": "builtin://demo"}, "engine": {"device": "cpu"}},
            }
        ),
    )
    wait_for(
        lambda: any(e["reason"] == "ApplyFailed" for e in cluster.events(NS, "flaky")),
        what="ApplyFailed",
    )
    wait_for(lambda: cluster.get("v1", "services", NS, "flaky"), what="the Service after a retry")
    wait_for(lambda: cluster.condition(NS, "flaky", c.DEGRADED).get("status") == "False")


def test_delete_collects_the_children(cluster: Cluster) -> None:
    cluster.kubectl("delete", "llmd", "qwen", "--timeout=20s")
    assert _deployment(cluster, "qwen") is None
    assert cluster.get("v1", "services", NS, "qwen") is None
    proc = cluster.kubectl.run("get", "deployment", "qwen", check=False)
    assert proc.returncode != 0 and "NotFound" in proc.stderr


def test_the_chart_rbac_allows_exactly_what_the_operator_did(cluster: Cluster) -> None:
    granted = granted_permissions()
    used = used_permissions(cluster.operator_requests())
    assert used - granted == set(), "the operator needs permissions the chart does not grant"
    # Granted but not exercised here: ownerReferences' blockOwnerDeletion needs update on
    # llmdeployments/finalizers; a PDB is only updated when a new operator renders it
    # differently; Kopf may get a CRD or a status by name.
    # The autoscaler's permissions are checked by tests/autoscaling/test_autoscaler_operator.py.
    expected_unused = {
        ("serving.kvscale.dev", "llmdeployments/scale", "patch"),
        ("coordination.k8s.io", "leases", "get"),
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "update"),
        ("serving.kvscale.dev", "llmdeployments/finalizers", "update"),
        ("policy", "poddisruptionbudgets", "update"),
        ("serving.kvscale.dev", "llmdeployments/status", "get"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "get"),
        # held only to be granted to the router's Role (Kubernetes refuses to let the
        # operator grant what it does not hold), and updates of the router's RBAC objects
        # only when a new operator renders them differently
        ("discovery.k8s.io", "endpointslices", "get"),
        ("discovery.k8s.io", "endpointslices", "list"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("", "pods", "get"),
        ("", "serviceaccounts", "update"),
        ("rbac.authorization.k8s.io", "roles", "update"),
        ("rbac.authorization.k8s.io", "rolebindings", "update"),
    }
    assert granted - used <= expected_unused, (
        f"granted but never used: {granted - used - expected_unused}"
    )


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"engine": {"extraArgs": ["--api-k", "x"]}}, "must not name (or abbreviate)"),
        ({"engine": {"extraArgs": ["--mod", "/etc"]}}, "must not name (or abbreviate)"),
        ({"env": [{"name": "KVSCALE_API_KEY", "value": ""}]}, "may not set a variable"),
        ({"engine": {"blockSize": 3}}, "Unsupported value"),
        ({"engine": {"maxQueueLen": 0}}, "greater than or equal to 1"),
    ],
)
def test_hostile_specs_are_refused_by_the_api_server(
    cluster: Cluster, spec: dict[str, Any], words: str
) -> None:
    """Flag smuggling, env overrides and specs that would crash-loop never get in (#14)."""
    body = {
        "apiVersion": LLMD_API,
        "kind": "LLMDeployment",
        "metadata": {"name": "hostile", "namespace": NS},
        "spec": {"model": {"source": "builtin://demo"}, **spec},
    }
    proc = cluster.kubectl.run("apply", "-f", "-", input=yaml.safe_dump(body), check=False)
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr
    assert cluster.llmd(NS, "hostile") is None


def test_a_server_flag_value_the_server_would_refuse_makes_no_pods(cluster: Cluster) -> None:
    """The CRD cannot check extraArgs' values; the operator does (a table of the server's
    flags): the spec is Degraded with the reason and no Deployment is made."""
    body = {
        "apiVersion": LLMD_API,
        "kind": "LLMDeployment",
        "metadata": {"name": "badflag", "namespace": NS},
        "spec": {
            "model": {"source": "builtin://demo"},
            "engine": {"extraArgs": ["--cuda-graph-mode", "fast"]},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
    degraded = wait_for(
        lambda: (
            cluster.condition(NS, "badflag", c.DEGRADED).get("status") == "True"
            and cluster.condition(NS, "badflag", c.DEGRADED)
        ),
        what="badflag Degraded",
    )
    assert degraded["reason"] == "InvalidSpec", degraded
    assert "spec.engine.extraArgs: --cuda-graph-mode must be one of auto" in degraded["message"]
    assert _deployment(cluster, "badflag") is None
    cluster.kubectl("delete", "llmdeployment", "badflag", "-n", NS)
    wait_for(lambda: cluster.llmd(NS, "badflag") is None, what="badflag deleted")


def test_operator_log_has_no_errors(cluster: Cluster) -> None:
    log = Path(cluster.operator.log).read_text()
    lines = log.splitlines()
    assert not [line for line in lines if "Traceback" in line]
    # Kopf logs the retries it was asked for (missing Secrets, the injected 500) as errors;
    # anything else would be a crash.
    # ... and the one invalid spec made on purpose (failed permanently: nothing to retry)
    errors = [
        line
        for line in lines
        if "[ERROR" in line
        and "failed temporarily" not in line
        and "invalid spec: spec.engine.extraArgs: --cuda-graph-mode" not in line
    ]
    assert errors == [], "\n".join(errors)
    retries = [line for line in lines if "failed temporarily" in line]
    assert retries and all(("Secret ml/" in line or "500" in line) for line in retries)
