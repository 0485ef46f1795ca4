"""The documented path on a real cluster: install the chart, apply an LLMDeployment, talk to
the server through its Service, scale it, change it, delete it. CPU only (demo model)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.conftest import KUBECTL, ROOT

SYSTEM_NS = "kvscale-e2e-system"
NS = "kvscale-e2e"
SERVER_IMAGE = os.environ.get("KVSCALE_E2E_SERVER_IMAGE", "kvscale-server:e2e")
OPERATOR_IMAGE = os.environ.get("KVSCALE_E2E_OPERATOR_IMAGE", "kvscale-operator:e2e")


def kubectl(*args: str, input: str | None = None, timeout: float = 660) -> str:
    proc = subprocess.run(
        [KUBECTL, *args], input=input, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {proc.stderr}")
    return proc.stdout


def _image(ref: str) -> dict[str, str]:
    repo, _, tag = ref.rpartition(":")
    return {"repository": repo, "tag": tag}


@pytest.fixture(scope="module")
def operator() -> Iterator[None]:
    import helm_python as helm

    kubectl("apply", "-f", str(ROOT / "crds"))
    kubectl(
        "wait",
        "--for=condition=Established",
        "crd/llmdeployments.serving.kvscale.dev",
        "--timeout=60s",
    )
    for ns in (SYSTEM_NS, NS):
        kubectl(
            "apply", "-f", "-", input=f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n"
        )
    values = {
        "image": {**_image(OPERATOR_IMAGE), "pullPolicy": "IfNotPresent"},
        "serverImage": _image(SERVER_IMAGE),
        "retryDelaySeconds": 5,
    }
    with helm.Chart.load(ROOT / "charts" / "kvscale") as chart:
        rendered = chart.render(values, name="kvscale", namespace=SYSTEM_NS, is_install=True)
    manifests = "\n---\n".join(
        text for path, text in sorted(rendered.items()) if path.endswith(".yaml")
    )
    kubectl("-n", SYSTEM_NS, "apply", "-f", "-", input=manifests)
    kubectl("-n", SYSTEM_NS, "rollout", "status", "deployment/kvscale", "--timeout=180s")
    try:
        yield
    finally:
        kubectl("delete", "namespace", NS, "--wait=true", "--timeout=180s")
        kubectl("-n", SYSTEM_NS, "delete", "-f", "-", "--ignore-not-found", input=manifests)
        kubectl("delete", "namespace", SYSTEM_NS, "--ignore-not-found", "--timeout=180s")


def _llmd() -> dict[str, Any]:
    return json.loads(kubectl("-n", NS, "get", "llmd", "demo", "-o", "json"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _port_forward(target: str, remote_port: int, probe: str) -> Iterator[int]:
    """``kubectl port-forward`` to ``target`` on a free local port, once ``probe`` answers."""
    port = _free_port()
    forward = subprocess.Popen(
        [KUBECTL, "-n", NS, "port-forward", target, f"{port}:{remote_port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _call(port, probe)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield port
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def _call(port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as rsp:
        raw = rsp.read().decode()
    return json.loads(raw) if raw.startswith(("{", "[")) else raw


def test_demo_model_serves_scales_rolls_and_goes(operator: None) -> None:
    kubectl("-n", NS, "apply", "-f", str(ROOT / "e2e" / "manifests" / "llmdeployment-demo.yaml"))
    kubectl("-n", NS, "wait", "--for=condition=Ready", "llmd/demo", "--timeout=600s")
    status = _llmd()["status"]
    assert status["readyReplicas"] == 1 and status["endpoint"].startswith(
        "http://demo.kvscale-e2e.svc"
    )

    with _port_forward("svc/demo", 8000, "/v1/models") as port:
        models = _call(port, "/v1/models")
        assert [m["id"] for m in models["data"]] == ["demo"]
        out = _call(
            port, "/v1/completions", {"model": "demo", "prompt": "Kubernetes is", "max_tokens": 4}
        )
        assert out["choices"][0]["text"] is not None
        assert "kvscale:kv_cache_usage_perc" in _call(port, "/metrics")

    kubectl("-n", NS, "scale", "llmd", "demo", "--replicas=2")
    kubectl(
        "-n", NS, "wait", "--for=jsonpath={.status.readyReplicas}=2", "llmd/demo", "--timeout=600s"
    )
    kubectl("-n", NS, "get", "pdb", "demo")

    kubectl(
        "-n",
        NS,
        "patch",
        "llmd",
        "demo",
        "--type=merge",
        "-p",
        '{"spec":{"engine":{"maxNumSeqs":4}}}',
    )
    kubectl(
        "-n",
        NS,
        "wait",
        "--for=jsonpath={.status.observedGeneration}=3",
        "llmd/demo",
        "--timeout=60s",
    )
    kubectl("-n", NS, "rollout", "status", "deployment/demo", "--timeout=600s")
    kubectl("-n", NS, "wait", "--for=condition=Ready", "llmd/demo", "--timeout=600s")
    args = yaml.safe_load(kubectl("-n", NS, "get", "deployment", "demo", "-o", "yaml"))["spec"][
        "template"
    ]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "4"

    kubectl("-n", NS, "delete", "llmd", "demo", "--timeout=120s")
    kubectl("-n", NS, "wait", "--for=delete", "deployment/demo", "service/demo", "--timeout=120s")


def _events(name: str) -> list[str]:
    out = json.loads(
        kubectl("-n", NS, "get", "events", "--field-selector", f"involvedObject.name={name}",
                "-o", "json")
    )  # fmt: skip
    return [e.get("message", "") for e in out["items"] if e.get("reason") == "SuccessfulRescale"]


def _replicas(deployment: str) -> int:
    return int(kubectl("-n", NS, "get", "deployment", deployment, "-o",
                       "jsonpath={.spec.replicas}") or 0)  # fmt: skip


def test_scale_from_zero_behind_the_router(operator: None) -> None:
    """spec.router + minReplicas 0: the first request is held at the router and answered
    after a cold start; after the idle window the replicas return to 0."""
    manifest = ROOT / "e2e" / "manifests" / "llmdeployment-scale-to-zero.yaml"
    kubectl("-n", NS, "apply", "-f", str(manifest))
    deadline = time.monotonic() + 120
    while True:  # the router Deployment is the operator's to create: wait for it to exist
        try:
            kubectl("-n", NS, "get", "deployment", "cold-router")
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
    kubectl("-n", NS, "rollout", "status", "deployment/cold-router", "--timeout=600s")
    assert _replicas("cold") == 0
    with _port_forward("svc/cold", 8000, "/health") as port:  # the Service: router pods
        t0 = time.monotonic()
        body = {"model": "demo", "prompt": "Kubernetes is", "max_tokens": 4}
        out = _call(port, "/v1/completions", body, timeout=660)
        print(f"first request answered after {time.monotonic() - t0:.0f}s (0 -> 1 replica)")
        assert out["usage"]["completion_tokens"] == 4
    assert "New size: 1; 1 request held at the router, 0 replicas -> 1" in _events("cold")
    kubectl(
        "-n", NS, "wait", "--for=jsonpath={.status.desiredReplicas}=0", "llmd/cold",
        "--timeout=180s",
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while _replicas("cold") != 0:
        assert time.monotonic() < deadline, "the Deployment did not go back to 0 replicas"
        time.sleep(2)
    assert any("1 replica -> 0" in m for m in _events("cold"))
    kubectl("-n", NS, "delete", "llmd", "cold", "--timeout=120s")
