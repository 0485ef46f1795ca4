"""The Helm chart, linted and rendered with helm-python-sdk (Helm's own library)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.operator.conftest import CRD_PATH, ROOT

CHART = ROOT / "charts" / "kvscale"


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as chart:
        yield chart


def _render(
    chart: helm.Chart, values: dict[str, Any] | None = None
) -> dict[str, list[dict[str, Any]]]:
    out = chart.render(values or {}, name="kvscale", namespace="kvscale-system")
    docs: dict[str, list[dict[str, Any]]] = {}
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs[path.rsplit("/", 1)[-1]] = [d for d in yaml.safe_load_all(text) if d]
    docs["NOTES.txt"] = [{"text": out.get("kvscale/templates/NOTES.txt", "")}]
    return docs


def _kinds(docs: dict[str, list[dict[str, Any]]]) -> list[str]:
    return sorted(d["kind"] for name, items in docs.items() if name != "NOTES.txt" for d in items)


def test_lint_is_clean() -> None:
    for values in (
        {},
        {
            "serviceMonitor": {"enabled": True},
            "grafanaDashboard": {"enabled": True},
            "watchNamespaces": ["ml"],
        },
    ):
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_crds_are_the_top_level_crds(chart: helm.Chart) -> None:
    (crd,) = chart.crds
    assert (CHART / "crds" / CRD_PATH.name).read_text() == CRD_PATH.read_text()
    assert yaml.safe_load(crd["data"]) == yaml.safe_load(CRD_PATH.read_text())


def test_default_render(chart: helm.Chart) -> None:
    docs = _render(chart)
    assert _kinds(docs) == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "Deployment",
        "ServiceAccount",
    ]
    (deploy,) = docs["deployment.yaml"]
    pod = deploy["spec"]["template"]["spec"]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    (ctr,) = pod["containers"]
    assert ctr["image"] == "ghcr.io/kvscale/kvscale-operator:0.1.0"
    assert ctr["args"][:3] == ["run", "-m", "kvscale.operator.handlers"]
    assert "--all-namespaces" in ctr["args"] and "--standalone" in ctr["args"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in ctr["env"]}
    assert env["KVSCALE_SERVER_IMAGE"] == "ghcr.io/kvscale/kvscale-server:0.1.0"
    # The autoscaler: its default interval, the operator's own metrics, the Lease identity.
    assert env["KVSCALE_AUTOSCALE_INTERVAL_SECONDS"] == "15"
    assert env["KVSCALE_METRICS_PORT"] == "8081"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "KVSCALE_PROMETHEUS_URL" not in env  # no Prometheus: the pods are scraped directly
    assert {"name": "metrics", "containerPort": 8081} in ctr["ports"]
    notes = deploy["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == "8081"
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert ctr["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == docs["serviceaccount.yaml"][0]["metadata"]["name"]
    assert "kubectl apply -f examples/llmdeployment.yaml" in docs["NOTES.txt"][0]["text"]


def test_rbac_is_least_privilege(chart: helm.Chart) -> None:
    docs = _render(chart)
    rules = [r for d in docs["rbac.yaml"] if d["kind"] == "ClusterRole" for r in d["rules"]]
    flat = {
        (g, res, v)
        for r in rules
        for g in r["apiGroups"]
        for res in r["resources"]
        for v in r["verbs"]
    }
    assert all("*" not in item for item in flat)
    assert ("", "secrets", "get") in flat and not {
        ("", "secrets", v) for v in ("list", "watch", "create")
    } & flat
    # deletes: only what spec.router's pruning removes (never pods, secrets or CRDs)
    deletable = {(g, res) for g, res, v in flat if v == "delete"}
    assert deletable == {
        ("apps", "deployments"),
        ("", "services"),
        ("", "serviceaccounts"),
        ("rbac.authorization.k8s.io", "roles"),
        ("rbac.authorization.k8s.io", "rolebindings"),
        ("policy", "poddisruptionbudgets"),
    }
    # the router's Role grants reading EndpointSlices and pods: the operator holds both
    # (Kubernetes refuses to let it grant more than it has)
    for res, g in (("endpointslices", "discovery.k8s.io"), ("pods", "")):
        assert {(g, res, v) for v in ("get", "list", "watch")} <= flat
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "create") not in flat
    # The autoscaler: its Leases (never listed or deleted) and the scale subresource.
    assert {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} <= flat
    assert not {("coordination.k8s.io", "leases", v) for v in ("list", "delete")} & flat
    assert ("serving.kvscale.dev", "llmdeployments/scale", "patch") in flat
    # (test_operator_integration checks these rules against every request the operator made)


def test_autoscaler_values(chart: helm.Chart) -> None:
    docs = _render(
        chart,
        {
            "prometheusUrl": "http://prometheus.monitoring:9090",
            "autoscalerIntervalSeconds": 30,
            "metricsPort": 0,
            "podAnnotations": {"team": "ml"},
        },
    )
    template = docs["deployment.yaml"][0]["spec"]["template"]
    (ctr,) = template["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert env["KVSCALE_PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"
    assert env["KVSCALE_AUTOSCALE_INTERVAL_SECONDS"] == "30"
    assert env["KVSCALE_METRICS_PORT"] == "0"
    assert [p["name"] for p in ctr["ports"]] == ["health"]
    assert template["metadata"]["annotations"] == {"team": "ml"}


def test_namespaced_install_uses_roles(chart: helm.Chart) -> None:
    docs = _render(chart, {"watchNamespaces": ["ml", "team-b"]})
    roles = [d for d in docs["rbac.yaml"] if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "team-b"]
    cluster_roles = [d for d in docs["rbac.yaml"] if d["kind"] == "ClusterRole"]
    assert [r["rules"][0]["resources"] for r in cluster_roles] == [["customresourcedefinitions"]]
    args = docs["deployment.yaml"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--all-namespaces" not in args


def test_service_monitor_and_dashboard(chart: helm.Chart) -> None:
    docs = _render(
        chart,
        {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "grafanaDashboard": {"enabled": True},
        },
    )
    (monitor,) = docs["servicemonitor.yaml"]
    assert (
        monitor["kind"] == "ServiceMonitor" and monitor["metadata"]["labels"]["release"] == "prom"
    )
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "kvscale-server"
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    (dashboard,) = docs["grafana-dashboard.yaml"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["kvscale-servers.json"])
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p["targets"])
    for metric in (
        "kvscale:kv_cache_usage_perc",
        "kvscale:num_requests_running",
        "kvscale:num_requests_waiting",
    ):
        assert metric in exprs
    assert "servicemonitor.yaml" not in _render(chart) or not _render(chart)["servicemonitor.yaml"]


@pytest.mark.parametrize(
    "values",
    [
        {"watchNamespaces": ["Not_A_Namespace"]},
        {"image": {"repository": ""}},
        {"logLevel": "chatty"},
        {"serviceMonitor": {"interval": "often"}},
        {"autoscalerIntervalSeconds": 0},
        {"metricsPort": "8081"},
        {"replicaCount": 2},  # not a value of this chart: a typo must not pass silently
    ],
)
def test_values_schema_refuses_bad_values(chart: helm.Chart, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values(values))
