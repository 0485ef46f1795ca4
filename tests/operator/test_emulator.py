"""The Kubernetes API emulator behaves like an API server where the operator relies on it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import kmock
import pytest
import requests

from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.conftest import CRD_PATH

NS = "emu"
DEPLOY = "/apis/apps/v1/namespaces/emu/deployments"
LLMD = "/apis/serving.kvscale.dev/v1alpha1/namespaces/emu/llmdeployments"


@pytest.fixture(scope="module")
def emu() -> Iterator[EmulatorThread]:
    with EmulatorThread() as emu:
        emu.apply_yaml(CRD_PATH.read_text())
        emu.apply_yaml(f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n")
        yield emu


@pytest.fixture
def http(emu: EmulatorThread) -> Iterator[Any]:
    with requests.Session() as session:

        def call(
            method: str, path: str, body: Any = None, ctype: str = "application/json", **params: str
        ):
            data = None if body is None else json.dumps(body)
            rsp = session.request(
                method,
                emu.url + path,
                data=data,
                params=params,
                headers={"Content-Type": ctype},
                timeout=10,
            )
            return rsp.status_code, rsp.json() if rsp.content else None

        yield call


def _deployment(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels or {}, **meta},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"a": name}},
            "template": {
                "metadata": {"labels": {"a": name}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }


def test_server_sets_metadata(http: Any) -> None:
    code, obj = http("POST", DEPLOY, _deployment("meta"))
    assert code == 201
    meta = obj["metadata"]
    assert meta["uid"] and meta["resourceVersion"].isdigit() and meta["generation"] == 1
    assert meta["creationTimestamp"].endswith("Z") and meta["namespace"] == NS
    code, obj = http(
        "POST",
        "/api/v1/namespaces/emu/events",
        {"metadata": {"generateName": "ev-"}, "reason": "R"},
    )
    assert (
        code == 201
        and obj["metadata"]["name"].startswith("ev-")
        and len(obj["metadata"]["name"]) == 8
    )
    assert http("POST", DEPLOY, _deployment("meta"))[0] == 409
    assert http("POST", "/apis/apps/v1/namespaces/nope/deployments", _deployment("x"))[0] == 404


def test_lists_carry_kind_and_a_resource_version(http: Any) -> None:
    code, listing = http("GET", DEPLOY)
    assert (
        code == 200 and listing["kind"] == "DeploymentList" and listing["apiVersion"] == "apps/v1"
    )
    assert listing["metadata"]["resourceVersion"].isdigit()
    assert all(item["kind"] == "Deployment" for item in listing["items"])
    code, namespaces = http("GET", "/api/v1/namespaces")
    assert {"default", NS} <= {n["metadata"]["name"] for n in namespaces["items"]}
    assert http("GET", f"/api/v1/namespaces/{NS}")[1]["status"]["phase"] == "Active"


def test_discovery_has_the_core_group_and_crds(http: Any) -> None:
    assert http("GET", "/api")[1]["versions"] == ["v1"]
    core = {r["name"] for r in http("GET", "/api/v1")[1]["resources"]}
    assert {"pods", "services", "secrets", "events", "namespaces"} <= core
    groups = {g["name"] for g in http("GET", "/apis")[1]["groups"]}
    assert {"apps", "policy", "apiextensions.k8s.io", "serving.kvscale.dev"} <= groups
    resources = {
        r["name"]: r for r in http("GET", "/apis/serving.kvscale.dev/v1alpha1")[1]["resources"]
    }
    assert (
        resources["llmdeployments"]["shortNames"] == ["llmd"]
        and resources["llmdeployments"]["namespaced"]
    )
    assert {"llmdeployments/status", "llmdeployments/scale"} <= set(resources)
    crd = http(
        "GET",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/llmdeployments.serving.kvscale.dev",
    )[1]
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"


def test_put_needs_the_current_resource_version(http: Any) -> None:
    _, obj = http("POST", DEPLOY, _deployment("put"))
    rv = obj["metadata"]["resourceVersion"]
    same = http("PUT", f"{DEPLOY}/put", obj)[1]
    assert same["metadata"]["resourceVersion"] == rv  # a no-op write changes nothing
    obj["spec"]["replicas"] = 3
    code, new = http("PUT", f"{DEPLOY}/put", obj)
    assert (
        code == 200
        and new["metadata"]["generation"] == 2
        and int(new["metadata"]["resourceVersion"]) > int(rv)
    )
    code, err = http("PUT", f"{DEPLOY}/put", obj)  # stale resourceVersion
    assert code == 409 and err["reason"] == "Conflict"
    new["metadata"]["labels"] = {"x": "y"}
    assert http("PUT", f"{DEPLOY}/put", new)[1]["metadata"]["generation"] == 2  # metadata only


def test_status_subresource(http: Any) -> None:
    http("POST", DEPLOY, _deployment("st"))
    _, obj = http(
        "PATCH", f"{DEPLOY}/st", {"status": {"readyReplicas": 5}}, "application/merge-patch+json"
    )
    assert (
        "status" not in obj or "readyReplicas" not in obj["status"]
    )  # main resource ignores status
    _, obj = http(
        "PATCH",
        f"{DEPLOY}/st/status",
        {"status": {"readyReplicas": 1}, "spec": {"replicas": 9}},
        "application/merge-patch+json",
    )
    assert (
        obj["status"]["readyReplicas"] == 1
        and obj["spec"]["replicas"] == 1
        and obj["metadata"]["generation"] == 1
    )


def test_patch_types(http: Any) -> None:
    http("POST", DEPLOY, _deployment("pt", {"keep": "1", "drop": "1"}))
    _, obj = http(
        "PATCH",
        f"{DEPLOY}/pt",
        {"metadata": {"labels": {"drop": None}}},
        "application/merge-patch+json",
    )
    assert obj["metadata"]["labels"] == {"keep": "1"}
    rv = obj["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]
    code, obj = http("PATCH", f"{DEPLOY}/pt", ops, "application/json-patch+json")
    assert code == 200 and obj["metadata"]["finalizers"] == ["x/y"]
    code, _ = http(
        "PATCH", f"{DEPLOY}/pt", ops, "application/json-patch+json"
    )  # the guard fails now
    assert code == 422
    smp = {"spec": {"template": {"spec": {"containers": [{"name": "side", "image": "s"}]}}}}
    _, obj = http("PATCH", f"{DEPLOY}/pt", smp, "application/strategic-merge-patch+json")
    assert [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]] == ["c", "side"]


def test_label_and_field_selectors(http: Any) -> None:
    for name, tier in (("sel-a", "web"), ("sel-b", "db"), ("sel-c", None)):
        http("POST", DEPLOY, _deployment(name, {"app": "sel", **({"tier": tier} if tier else {})}))

    def names(**params: str) -> set[str]:
        return {i["metadata"]["name"] for i in http("GET", DEPLOY, **params)[1]["items"]}

    assert names(labelSelector="app=sel,tier=web") == {"sel-a"}
    assert names(labelSelector="app=sel,tier in (web,db)") == {"sel-a", "sel-b"}
    assert names(labelSelector="app=sel,!tier") == {"sel-c"}
    assert names(labelSelector="app=sel,tier!=web") == {"sel-b", "sel-c"}
    assert names(fieldSelector="metadata.name=sel-b") == {"sel-b"}


def _watch(
    emu: EmulatorThread, path: str, out: list[dict[str, Any]], **params: str
) -> threading.Thread:
    def run() -> None:
        with requests.get(
            emu.url + path, params={"watch": "true", **params}, stream=True, timeout=20
        ) as rsp:
            out.append({"content-type": rsp.headers["Content-Type"]})
            for line in rsp.iter_lines():
                if line:
                    out.append(json.loads(line))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_watch_resumes_from_a_resource_version_without_losing_events(
    emu: EmulatorThread, http: Any
) -> None:
    rv = http("GET", DEPLOY)[1]["metadata"]["resourceVersion"]
    http("POST", DEPLOY, _deployment("w1", {"w": "1"}))
    http("PATCH", f"{DEPLOY}/w1", {"spec": {"replicas": 2}}, "application/merge-patch+json")
    http(
        "PATCH",
        f"{DEPLOY}/w1",
        {"metadata": {"labels": {"w": None}}},
        "application/merge-patch+json",
    )
    http("DELETE", f"{DEPLOY}/w1")
    events: list[dict[str, Any]] = []
    selected: list[dict[str, Any]] = []
    threads = [
        _watch(
            emu, DEPLOY, events, resourceVersion=rv, allowWatchBookmarks="true", timeoutSeconds="3"
        ),
        _watch(emu, DEPLOY, selected, resourceVersion=rv, labelSelector="w=1", timeoutSeconds="3"),
    ]
    for thread in threads:
        thread.join(timeout=10)
    assert events[0]["content-type"].startswith("application/json")
    mine = [
        (e["type"], e["object"]["metadata"].get("name"))
        for e in events[1:]
        if e["type"] != "BOOKMARK"
    ]
    assert mine == [("ADDED", "w1"), ("MODIFIED", "w1"), ("MODIFIED", "w1"), ("DELETED", "w1")]
    assert any(e.get("type") == "BOOKMARK" for e in events[1:])  # idle streams get bookmarks
    assert [e["type"] for e in selected[1:]] == [
        "ADDED",
        "MODIFIED",
        "DELETED",
    ]  # left the selector
    rvs = [
        int(e["object"]["metadata"]["resourceVersion"])
        for e in events[1:]
        if e["type"] != "BOOKMARK"
    ]
    assert rvs == sorted(rvs)


def test_custom_resources_are_defaulted_and_validated(http: Any) -> None:
    good = {
        "apiVersion": "serving.kvscale.dev/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "good"},
        "spec": {"model": {"source": "builtin://demo"}, "engine": {"device": "cpu"}},
    }
    code, obj = http("POST", LLMD, good)
    assert (
        code == 201
        and obj["spec"]["engine"]["tensorParallelSize"] == 1
        and obj["spec"]["replicas"] == 1
    )
    bad = {
        **good,
        "metadata": {"name": "bad"},
        "spec": {"model": {"source": "hf://a/b"}, "engine": {"tensorParallelSize": 3}},
    }
    code, err = http("POST", LLMD, bad)
    assert code == 422 and err["reason"] == "Invalid"
    assert "spec.engine.tensorParallelSize" in err["message"] and "power of two" in err["message"]
    assert err["details"]["causes"][0]["field"] == "spec.engine.tensorParallelSize"
    typo = {
        **good,
        "metadata": {"name": "typo"},
        "spec": {"model": {"source": "builtin://demo"}, "replica": 2},
    }
    assert http("POST", LLMD, typo, fieldValidation="Strict")[0] == 400
    code, obj = http("POST", LLMD, typo)  # without Strict: pruned, like the API server
    assert code == 201 and "replica" not in obj["spec"]
    code, err = http(
        "PATCH",
        f"{LLMD}/good",
        {"spec": {"autoscaling": {"minReplicas": 9}}},
        "application/merge-patch+json",
    )
    assert code == 422 and "minReplicas must be less than or equal" in err["message"]


def test_scale_subresource(http: Any) -> None:
    code, scale = http("GET", f"{LLMD}/good/scale")
    assert code == 200 and scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    _, scale = http(
        "PATCH", f"{LLMD}/good/scale", {"spec": {"replicas": 4}}, "application/merge-patch+json"
    )
    assert scale["spec"]["replicas"] == 4
    assert http("GET", f"{LLMD}/good")[1]["spec"]["replicas"] == 4


def test_owner_references_are_garbage_collected(http: Any) -> None:
    _, owner = http(
        "POST",
        LLMD,
        {
            "apiVersion": "serving.kvscale.dev/v1alpha1",
            "kind": "LLMDeployment",
            "metadata": {"name": "owner"},
            "spec": {"model": {"source": "builtin://demo"}, "engine": {"device": "cpu"}},
        },
    )
    ref = {
        "apiVersion": "serving.kvscale.dev/v1alpha1",
        "kind": "LLMDeployment",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }
    _, child = http("POST", DEPLOY, _deployment("child", ownerReferences=[ref]))
    grandchild_ref = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "child",
        "uid": child["metadata"]["uid"],
    }
    http(
        "POST",
        "/api/v1/namespaces/emu/pods",
        {
            "metadata": {"name": "grandchild", "ownerReferences": [grandchild_ref]},
            "spec": {"containers": []},
        },
    )
    assert http("DELETE", f"{LLMD}/owner")[0] == 200
    assert http("GET", f"{DEPLOY}/child")[0] == 404
    assert http("GET", "/api/v1/namespaces/emu/pods/grandchild")[0] == 404


def test_finalizers_hold_deletion(http: Any) -> None:
    http("POST", DEPLOY, _deployment("fin", finalizers=["kvscale.dev/test"]))
    code, obj = http("DELETE", f"{DEPLOY}/fin")
    assert code == 200 and obj["metadata"]["deletionTimestamp"]
    assert http("GET", f"{DEPLOY}/fin")[0] == 200
    http(
        "PATCH", f"{DEPLOY}/fin", {"metadata": {"finalizers": None}}, "application/merge-patch+json"
    )
    assert http("GET", f"{DEPLOY}/fin")[0] == 404


def test_reactions_inject_faults_and_requests_are_logged(emu: EmulatorThread, http: Any) -> None:
    emu.call(lambda: emu.api["post /api/v1/namespaces/emu/services"][:1] << 503)
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "flaky"},
        "spec": {"ports": [{"port": 80}]},
    }
    assert http("POST", "/api/v1/namespaces/emu/services", svc)[0] == 503
    code, obj = http("POST", "/api/v1/namespaces/emu/services", svc)
    assert code == 201 and obj["spec"]["clusterIP"]
    posts = emu.call(lambda: list(emu.api[kmock.method.POST, kmock.resource("", "v1", "services")]))
    assert len(posts) == 2
