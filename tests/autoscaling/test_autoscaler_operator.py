"""Two real operators (``kopf run``) autoscaling one LLMDeployment in the API emulator.

The pods are tiny HTTP servers whose ``/metrics`` the test sets, and no Prometheus is
configured, so the operator scrapes the ready pods itself. Only the Lease holder evaluates;
the other one never writes, so nothing is scaled twice; when the holder stops, the other
takes over. One module, tests in order, a 1 s interval and a 4 s scale-down window.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvscale.operator import constants as c
from kvscale.operator.leader import lease_name
from tests.autoscaling.harness import FakeKubelet, llmd_manifest
from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.harness import (
    Kubectl,
    Operator,
    emulated_cluster,
    granted_permissions,
    used_permissions,
    wait_for,
)
from tests.ports import free_port

NS, NAME = "ml", "auto"
APPS = "apps/v1"
INTERVAL, WINDOW = 1, 4


class MetricsPod:
    """A pod's ``/metrics``: the two gauges the autoscaler reads, settable; or an error."""

    def __init__(self) -> None:
        self.kv, self.waiting, self.status = 0.0, 0.0, 200
        pod = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (
                    f'kvscale:kv_cache_usage_perc{{model_name="demo"}} {pod.kv}\n'
                    f'kvscale:num_requests_waiting{{model_name="demo"}} {pod.waiting}\n'
                ).encode()
                self.send_response(pod.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@dataclass
class Setup:
    emu: EmulatorThread
    kubectl: Kubectl
    operators: dict[str, Operator]
    metrics_ports: dict[str, int]
    pods: list[MetricsPod]

    def set(self, kv: float, waiting: float = 0.0, status: int = 200) -> None:
        for pod in self.pods:
            pod.kv, pod.waiting, pod.status = kv, waiting, status

    def llmd(self) -> dict[str, Any]:
        return self.emu.get(c.API_VERSION, c.PLURAL, NS, NAME) or {}

    def replicas(self) -> int:
        return int(
            (self.emu.get(APPS, "deployments", NS, NAME) or {"spec": {}})["spec"]["replicas"]
        )

    def condition(self) -> dict[str, Any]:
        for cond in (self.llmd().get("status") or {}).get("conditions") or ():
            if cond["type"] == c.SCALING_ACTIVE:
                return cond
        return {}

    def holder(self) -> str | None:
        lease = self.emu.get("coordination.k8s.io/v1", "leases", NS, lease_name(NAME))
        return ((lease or {}).get("spec") or {}).get("holderIdentity")

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.emu.list("v1", "events", NS)
            if e.get("reason") == reason and e["involvedObject"].get("name") == NAME
        ]

    def deployment_replica_history(self) -> list[int]:
        """Every version of the Deployment's spec.replicas, in order, without repeats."""

        def versions() -> list[int]:
            key = ("apps/v1/deployments", NS, NAME)
            return [v["spec"]["replicas"] for v in self.emu.api.objects[key].history]

        out: list[int] = []
        for n in self.emu.call(versions):
            if not out or out[-1] != n:
                out.append(n)
        return out

    def requests_by(self, identity: str) -> list[Any]:
        return [
            r
            for r in self.emu.call(lambda: list(self.emu.api))
            if f"({identity})" in r.headers.get("User-Agent", "")
        ]

    def operator_metrics(self, identity: str) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[identity]}/metrics").text
        return {
            s.name + str(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    pods = [MetricsPod() for _ in range(3)]
    with EmulatorThread() as emu:
        root = tmp_path_factory.mktemp("autoscaler")
        kubeconfig, kubectl = emulated_cluster(emu, root, NS)
        ports = {"op-a": free_port(), "op-b": free_port()}
        operators = {}
        for identity, port in ports.items():
            workdir = tmp_path_factory.mktemp(identity)
            operators[identity] = Operator(
                kubeconfig,
                workdir,
                KVSCALE_OPERATOR_ID=identity,
                KVSCALE_METRICS_PORT=str(port),
            )
            operators[identity].start()
        manifest = llmd_manifest(
            NAME,
            NS,
            {
                "maxReplicas": 3,
                "targetKVCacheUtilizationPercent": 50,
                "targetQueueDepthPerReplica": 2,
                "intervalSeconds": INTERVAL,
                "scaleDownStabilizationWindowSeconds": WINDOW,
            },
        )
        kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
        kubelet = FakeKubelet(emu, NS, NAME, [p.port for p in pods])
        kubelet.start()
        try:
            yield Setup(emu, kubectl, operators, ports, pods)
        except BaseException:
            for op in operators.values():
                print(op.tail())
            raise
        finally:
            kubelet.stop()
            for op in operators.values():
                op.stop()
            for pod in pods:
                pod.server.shutdown()
            assert kubelet.errors == []


def test_one_operator_holds_the_lease(setup: Setup) -> None:
    holder = wait_for(setup.holder, what="a Lease holder")
    assert holder in ("op-a", "op-b")
    assert "finalizers" not in setup.llmd()["metadata"]  # nothing blocks a deletion
    cond = wait_for(
        lambda: setup.condition().get("reason") == "ValidMetricFound" and setup.condition()
    )
    assert cond["status"] == "True"
    assert "avg KV usage 0.00 < target 0.50 on 1 replica -> 1" in cond["message"]
    other = "op-b" if holder == "op-a" else "op-a"
    key = f"[('llmdeployment', '{NAME}'), ('namespace', '{NS}')]"
    gauge = "kvscale_operator_autoscaler_leader"
    wait_for(lambda: setup.operator_metrics(holder).get(gauge + key) == 1.0, what="leader=1")
    wait_for(lambda: setup.operator_metrics(other).get(gauge + key) == 0.0, what="leader=0")


def test_the_leader_scales_up_once_per_decision(setup: Setup) -> None:
    holder = setup.holder()
    setup.set(kv=0.9)
    wait_for(lambda: setup.replicas() == 3, timeout=15, what="3 replicas")
    time.sleep(3 * INTERVAL)  # a double-scaling second operator would act by now
    assert setup.deployment_replica_history() == [1, 2, 3]  # no overshoot, no repeat
    rescales = setup.events("SuccessfulRescale")
    assert [e["message"].split(";")[0] for e in rescales] == ["New size: 2", "New size: 3"]
    assert "avg KV usage 0.90 > target 0.50 on 1 replica -> 2" in rescales[0]["message"]
    other = "op-b" if holder == "op-a" else "op-a"
    writes = [r for r in setup.requests_by(other) if r.method.value in ("PATCH", "PUT", "POST")]
    lease_tries = [r for r in writes if r.resource and r.resource.plural == "leases"]
    # At most the creation race it lost at start (409); then it saw a live holder.
    assert [r.method.value for r in lease_tries] in ([], ["POST"])
    lease = setup.emu.get("coordination.k8s.io/v1", "leases", NS, lease_name(NAME))
    assert lease["spec"]["holderIdentity"] == holder and lease["spec"]["leaseTransitions"] == 0
    # Its reconcile passes may refresh the status like any operator replica's, but never
    # with the autoscaler's fields, and it never touches the scale subresource.
    assert not [r for r in writes if r.subresource == "scale"]
    autoscaler_keys = {"lastScaleTime", "lastScaleReason", "kvCacheUsagePercent"}
    assert not [
        r
        for r in writes
        if r.subresource == "status" and autoscaler_keys & set((r.data or {}).get("status") or {})
    ]
    scale_writes = [r for r in setup.requests_by(holder) if r.subresource == "scale"]
    assert len(scale_writes) == 2


def test_status_and_the_scale_subresource(setup: Setup) -> None:
    status = setup.llmd()["status"]
    assert status["desiredReplicas"] == 3 and status["kvCacheUsagePercent"] == 90
    assert status["queueDepthPerReplica"] == 0
    assert status["lastScaleReason"].startswith(
        "avg KV usage 0.90 > target 0.50 on 2 replicas -> 3"
    )
    assert status["lastScaleTime"].endswith("Z")

    # status.replicas and READY follow the Deployment's status, which the kubelet reports
    # after the scale-up: on a loaded machine that can trail the decision by seconds.
    def row() -> list[str]:
        return setup.kubectl("get", "llmd", NAME).splitlines()[1].split()

    wait_for(lambda: row()[3] == "3", what="READY 3")
    scale = setup.kubectl.json("get", "llmd", NAME, "--subresource=scale")
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert row()[3:6] == ["3", "3", "90"]  # READY DESIRED KV%


def test_unreadable_metrics_keep_the_replicas(setup: Setup) -> None:
    setup.set(kv=0.0, status=500)
    cond = wait_for(
        lambda: setup.condition().get("status") == "False" and setup.condition(), what="False"
    )
    assert cond["reason"] == "PodMetricsUnreachable"
    assert "cannot read /metrics of any ready pod" in cond["message"]
    assert cond["message"].endswith("keeping 3 replicas") and "HTTP 500" in cond["message"]
    warnings = wait_for(lambda: setup.events("FailedGetMetrics"))
    assert warnings[0]["type"] == "Warning"
    assert "kvCacheUsagePercent" not in setup.llmd()["status"]  # no stale numbers shown
    time.sleep(WINDOW + 2 * INTERVAL)  # idle pods would be scaled down by now
    assert setup.replicas() == 3 and setup.condition()["status"] == "False"
    assert len(setup.events("FailedGetMetrics")) == 1  # one warning per failure, not per try


def test_scale_down_waits_for_the_window(setup: Setup) -> None:
    setup.set(kv=0.05)
    cond = wait_for(
        lambda: setup.condition().get("reason") == "ValidMetricFound" and setup.condition(),
        what="metrics again",
    )
    recovered = time.monotonic()
    # Failed evaluations recorded nothing, so the history starts afresh, seeded with 3.
    assert "held at 3 by the highest recommendation of the last 4s" in cond["message"]
    wait_for(lambda: setup.replicas() == 1, timeout=WINDOW + 10, what="1 replica")
    assert time.monotonic() - recovered >= WINDOW - INTERVAL
    assert setup.deployment_replica_history() == [1, 2, 3, 1]  # straight down to minReplicas


def test_the_other_operator_takes_over(setup: Setup) -> None:
    holder = setup.holder()
    other = "op-b" if holder == "op-a" else "op-a"
    setup.operators[holder].stop()
    wait_for(lambda: setup.holder() == other, timeout=10, what="the hand-over")
    setup.set(kv=0.9)
    wait_for(lambda: setup.replicas() == 2, timeout=10, what="a scale-up by the new leader")
    # The Deployment follows the scale write (the reconcile handler sees the spec change)
    # before the leader's evaluation returns and counts it: on a loaded machine, later.
    up = "kvscale_operator_autoscaler_decisions_total[('direction', 'up')]"
    metrics = wait_for(
        lambda: (m := setup.operator_metrics(other)).get(up, 0) >= 1 and m,
        timeout=10,
        what="the new leader's scale-up counted",
    )
    key = f"[('llmdeployment', '{NAME}'), ('namespace', '{NS}')]"
    assert metrics["kvscale_operator_autoscaler_desired_replicas" + key] >= 2
    last = metrics["kvscale_operator_autoscaler_last_reconcile_timestamp_seconds" + key]
    assert time.time() - last < 5 * INTERVAL


def test_disabling_autoscaling_stops_the_loop_and_frees_the_lease(setup: Setup) -> None:
    setup.kubectl(
        "patch", "llmd", NAME, "--type=merge", "-p", '{"spec":{"autoscaling":{"enabled":false}}}'
    )
    wait_for(lambda: setup.condition().get("reason") == "AutoscalingDisabled", what="disabled")
    wait_for(lambda: setup.holder() is None, what="the Lease released")
    replicas = setup.replicas()
    time.sleep(3 * INTERVAL)
    assert setup.replicas() == replicas  # spec.replicas was kept in step: nothing jumps


def test_the_chart_rbac_allows_what_the_autoscaler_did(setup: Setup) -> None:
    requests = setup.requests_by("op-a") + setup.requests_by("op-b")
    used = used_permissions(requests)
    assert ("coordination.k8s.io", "leases", "update") in used
    assert ("serving.kvscale.dev", "llmdeployments/scale", "patch") in used
    assert used - granted_permissions() == set()


def test_operator_logs_are_clean(setup: Setup) -> None:
    for op in setup.operators.values():
        lines = op.log.read_text().splitlines()
        assert not [line for line in lines if "Traceback" in line]
        # Two replicas reconciling the same object race to create its children; the loser
        # gets a 409 and Kopf retries (both converge). Nothing else may be an error.
        errors = [line for line in lines if "[ERROR" in line]
        assert all("failed temporarily" in e and "while" in e for e in errors), errors


def test_an_autoscaled_llmdeployment_deletes_without_the_operator(setup: Setup) -> None:
    setup.kubectl(
        "patch", "llmd", NAME, "--type=merge", "-p", '{"spec":{"autoscaling":{"enabled":true}}}'
    )
    wait_for(setup.holder, what="a Lease holder again")
    for op in setup.operators.values():
        op.stop()
    setup.kubectl("delete", "llmd", NAME, "--timeout=10s")
    assert setup.llmd() == {}
    lease = setup.emu.get("coordination.k8s.io/v1", "leases", NS, lease_name(NAME))
    assert lease is None  # garbage-collected with its owner
