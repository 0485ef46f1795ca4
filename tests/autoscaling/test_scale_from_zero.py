"""Scale from zero, end to end: the API emulator, the real operator (``kopf run``), the
real router and real server processes that the harness starts when the Deployment's
replicas go 0 -> 1 (a cold start) and stops when they go back to 0.

The LLMDeployment starts at zero replicas. The first request is held at the router; the
autoscaler sees it in the router's ``kvscale_router:held_requests`` and scales 0 -> 1; the
request is answered once the server is ready; after ``scaleToZeroAfterSeconds`` without a
request the replicas return to 0 and the server process is gone.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from kvscale.operator import constants as c
from tests.autoscaling.harness import APPS, ColdStartKubelet, wait_until
from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.harness import Operator, emulated_cluster
from tests.ports import free_port

pytestmark = pytest.mark.slow
NS, NAME = "ml", "cold"
IDLE_S = 6  # spec.autoscaling.scaleToZeroAfterSeconds
MANIFEST = {
    "apiVersion": c.API_VERSION,
    "kind": c.KIND,
    "metadata": {"name": NAME, "namespace": NS},
    "spec": {
        "model": {"source": "builtin://demo", "maxModelLen": 512},
        "engine": {"device": "cpu", "maxNumSeqs": 4, "extraArgs": ["--num-kv-blocks", "64"]},
        "replicas": 0,
        "router": {"enabled": True, "holdTimeoutSeconds": 120},
        "autoscaling": {
            "enabled": True,
            "minReplicas": 0,
            "maxReplicas": 1,
            "intervalSeconds": 1,
            "scaleToZeroAfterSeconds": IDLE_S,
        },
    },
}


def _events(emu: EmulatorThread) -> list[dict[str, Any]]:
    return [
        e
        for e in emu.list("v1", "events", NS)
        if (e.get("involvedObject") or {}).get("name") == NAME
    ]


def _replicas(emu: EmulatorThread) -> int | None:
    dep = emu.get(APPS, "deployments", NS, NAME)
    return None if dep is None else dep["spec"].get("replicas")


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("scale-from-zero")
    with contextlib.ExitStack() as stack:
        emu = stack.enter_context(EmulatorThread())
        kubeconfig, kubectl = emulated_cluster(emu, workdir, NS)
        operator = Operator(
            kubeconfig, workdir, KVSCALE_OPERATOR_ID="operator-0",
            KVSCALE_METRICS_PORT=str(free_port()),
        )  # fmt: skip
        stack.callback(operator.stop)
        operator.start()
        kubelet = ColdStartKubelet(emu, NS, NAME, kubeconfig, workdir)
        stack.callback(kubelet.stop)
        kubelet.start()
        kubectl("apply", "-f", "-", input=yaml.safe_dump(MANIFEST))
        try:
            yield {"emu": emu, "kubelet": kubelet, "operator": operator}
        except BaseException:
            print(operator.tail())
            raise


def test_starts_at_zero_behind_a_ready_router(cold: dict[str, Any]) -> None:
    emu, kubelet = cold["emu"], cold["kubelet"]
    wait_until(lambda: _replicas(emu) == 0, 30, "the server Deployment at 0 replicas")
    wait_until(lambda: kubelet.router is not None, 30, "the router Deployment")
    wait_until(lambda: ColdStartKubelet._up(kubelet.router_url, "/health"), 90, "the router")

    def idle_verdict() -> str | None:
        status = (emu.get(c.API_VERSION, c.PLURAL, NS, NAME) or {}).get("status") or {}
        for cond in status.get("conditions") or ():
            if cond["type"] == c.SCALING_ACTIVE and cond["status"] == "True":
                return cond["message"]
        return None

    msg = wait_until(idle_verdict, 30, "the autoscaler reading the router")
    assert msg == "no request held at the router; keeping 0 replicas"
    assert kubelet.server is None and kubelet.cold_starts == 0


def test_the_first_request_is_held_and_answered(cold: dict[str, Any]) -> None:
    emu, kubelet = cold["emu"], cold["kubelet"]
    body = {"model": "demo", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True}
    t0 = time.monotonic()
    r = httpx.post(kubelet.router_url + "/v1/completions", json=body, timeout=150)
    waited = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert kubelet.cold_starts == 1 and _replicas(emu) == 1
    print(f"\nfirst request answered after {waited:.1f}s (a cold start: 0 -> 1 replica)")
    rescale = [e for e in _events(emu) if e["reason"] == "SuccessfulRescale"]
    assert [e["message"] for e in rescale] == [
        "New size: 1; 1 request held at the router, 0 replicas -> 1"
    ]
    held = httpx.get(kubelet.router_url + "/metrics", timeout=5).text
    assert "kvscale_router:hold_time_seconds_count 1.0" in held


def test_back_to_zero_after_the_idle_window(cold: dict[str, Any]) -> None:
    emu, kubelet = cold["emu"], cold["kubelet"]
    t0 = time.monotonic()
    wait_until(lambda: _replicas(emu) == 0, IDLE_S + 30, "the scale-down to 0")
    assert time.monotonic() - t0 <= IDLE_S + 15  # the window, evaluations every second
    wait_until(lambda: kubelet.server is None, 10, "the server process stopped")

    def rescales() -> list[str]:  # the event is posted after the scale is written
        found = [e["message"] for e in _events(emu) if e["reason"] == "SuccessfulRescale"]
        return found if len(found) >= 2 else []

    rescale = wait_until(rescales, 10, "the scale-down's SuccessfulRescale event")
    assert len(rescale) == 2 and rescale[1].startswith("New size: 0; no request at the router for ")
    assert rescale[1].endswith(f"(scaleToZeroAfterSeconds {IDLE_S}), 1 replica -> 0")

    def scaled_to_zero() -> dict[str, Any] | None:  # the pass after the scale writes it
        status = emu.get(c.API_VERSION, c.PLURAL, NS, NAME)["status"]
        ready = next(x for x in status["conditions"] if x["type"] == c.READY)
        return status if ready["reason"] == "ScaledToZero" else None

    status = wait_until(scaled_to_zero, 10, "the Ready condition's ScaledToZero")
    assert status["desiredReplicas"] == 0 and status["heldRequests"] == 0


def test_ran_cleanly(cold: dict[str, Any]) -> None:
    assert cold["kubelet"].errors == []
    log = cold["operator"].log.read_text(errors="replace")
    assert [line for line in log.splitlines() if "Traceback" in line or "[ERROR" in line] == []
    assert not [e for e in _events(cold["emu"]) if e["type"] == "Warning"]
