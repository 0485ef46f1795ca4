"""The end-to-end autoscaling scenario, shared by ``test_autoscaling_e2e.py`` and
``bench/autoscale_timeline.py``.

Real parts: Prometheus (1 s scrapes), ``kvscale serve`` processes on the demo model with a
32-block KV pool and 4 sequences at most (so a dozen users fill it), the operator
(``kopf run``) against the Kubernetes API emulator, and the benchmark client's requests as
load. The timeline: idle, ``load_s`` of load from ``concurrency`` users, then idle until
the Deployment is back at one replica and a little longer, sampled every half second.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvscale.operator import constants as c
from kvscale.operator import render
from kvscale.operator.spec import parse_spec
from tests.autoscaling.harness import (
    APPS,
    FakeKubelet,
    LoadDriver,
    PrometheusProcess,
    ScrapeTarget,
    ServerProcesses,
    background,
    llmd_manifest,
    read_metrics,
    wait_until,
)
from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.harness import Operator, emulated_cluster
from tests.ports import free_port

NS = "ml"
NAME = "demo"
LLMD_API = c.API_VERSION


@dataclass(frozen=True)
class ScenarioParams:
    """Short windows so that the whole scenario takes about a minute and a half."""

    interval_s: int = 2  # spec.autoscaling.intervalSeconds
    window_s: int = 12  # spec.autoscaling.scaleDownStabilizationWindowSeconds
    max_replicas: int = 3  # also the number of server processes
    target_kv_percent: int = 50
    target_queue: int = 2
    concurrency: int = 12  # users sending requests back to back
    input_len: int = 80  # tokens per prompt: 5 of the 32 blocks
    output_len: int = 48
    idle_before_s: float = 6.0
    load_s: float = 30.0
    settle_after_s: float = 8.0  # watched after the scale-down, for flapping
    sample_period_s: float = 0.5


class Recorder:
    """Samples replicas, the autoscaler's status and every ready pod's gauges."""

    def __init__(
        self, emu: EmulatorThread, kubelet: FakeKubelet, in_flight: Callable[[], int], period: float
    ) -> None:
        self.emu, self.kubelet, self.in_flight, self.period = emu, kubelet, in_flight, period
        self.samples: list[dict[str, Any]] = []

    def sample(self) -> dict[str, Any]:
        dep = self.emu.get(APPS, "deployments", NS, NAME) or {"spec": {}}
        status = (self.emu.get(LLMD_API, c.PLURAL, NS, NAME) or {}).get("status") or {}
        pods = {}
        for i, url in zip(list(self.kubelet.ready), self.kubelet.ready_urls(), strict=False):
            try:
                got = read_metrics(url, timeout=1.0)
            except httpx.HTTPError:
                continue
            pods[self.kubelet.pod_name(i)] = {
                "kv": got.get("kvscale:kv_cache_usage_perc"),
                "waiting": got.get("kvscale:num_requests_waiting"),
                "running": got.get("kvscale:num_requests_running"),
            }
        return {
            "t": time.time(),
            "replicas": dep["spec"].get("replicas"),
            "ready": len(self.kubelet.ready),
            "desired": status.get("desiredReplicas"),
            "status_kv_percent": status.get("kvCacheUsagePercent"),
            "status_queue": status.get("queueDepthPerReplica"),
            "pods": pods,
            "in_flight": self.in_flight(),
        }

    def run(self, stop: Callable[[], bool]) -> None:
        while not stop():
            started = time.monotonic()
            self.samples.append(self.sample())
            time.sleep(max(0.0, self.period - (time.monotonic() - started)))


def _events(emu: EmulatorThread) -> list[dict[str, Any]]:
    out = []
    for e in emu.list("v1", "events", NS):
        ref = e.get("involvedObject") or {}
        if ref.get("kind") == c.KIND and ref.get("name") == NAME:
            out.append(
                {
                    "type": e.get("type"),
                    "reason": e.get("reason"),
                    "message": e.get("message"),
                    "time": e.get("lastTimestamp") or e.get("eventTime"),
                }
            )
    return out


def run_scenario(
    workdir: Path, params: ScenarioParams | None = None, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Runs the scenario and returns its timeline (JSON-ready; times in unix seconds)."""
    p = params or ScenarioParams()
    manifest = llmd_manifest(
        NAME,
        NS,
        {
            "minReplicas": 1,
            "maxReplicas": p.max_replicas,
            "targetKVCacheUtilizationPercent": p.target_kv_percent,
            "targetQueueDepthPerReplica": p.target_queue,
            "intervalSeconds": p.interval_s,
            "scaleDownStabilizationWindowSeconds": p.window_s,
        },
    )
    args = render.server_args(parse_spec(manifest["spec"]))
    began = time.time()
    with contextlib.ExitStack() as stack:
        log(f"starting {p.max_replicas} x kvscale {' '.join(args)}")
        servers = ServerProcesses(workdir, args, p.max_replicas)
        stack.callback(servers.stop)
        emu = stack.enter_context(EmulatorThread())
        kubeconfig, kubectl = emulated_cluster(emu, workdir, NS)
        targets = [
            ScrapeTarget(f"127.0.0.1:{port}", NS, f"{NAME}-{i}", NAME)
            for i, port in enumerate(servers.ports)
        ]
        prometheus = PrometheusProcess(workdir, targets)
        stack.callback(prometheus.stop)
        operator = Operator(
            kubeconfig,
            workdir,
            KVSCALE_OPERATOR_ID="operator-0",
            KVSCALE_METRICS_PORT=str(free_port()),
        )
        stack.callback(operator.stop)
        operator.start()
        servers.wait_ready()
        prometheus.start()
        log(f"servers ready, Prometheus at {prometheus.url} ({time.time() - began:.0f}s)")
        manifest["spec"]["autoscaling"]["prometheusUrl"] = prometheus.url
        kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
        kubelet = FakeKubelet(emu, NS, NAME, servers.ports)
        kubelet.start()
        stack.callback(kubelet.stop)

        def scaling_active() -> bool:
            status = (emu.get(LLMD_API, c.PLURAL, NS, NAME) or {}).get("status") or {}
            return any(
                x["type"] == c.SCALING_ACTIVE and x["status"] == "True"
                for x in status.get("conditions") or ()
            )

        wait_until(scaling_active, 60, "the autoscaler's first valid evaluation")
        load = LoadDriver(
            kubelet.ready_urls,
            model=parse_spec(manifest["spec"]).model.served_model_name,
            concurrency=p.concurrency,
            input_len=p.input_len,
            output_len=p.output_len,
        )
        recorder = Recorder(emu, kubelet, lambda: load.in_flight, p.sample_period_s)
        done = threading.Event()
        with background(lambda: recorder.run(done.is_set), "recorder"):
            try:
                time.sleep(p.idle_before_s)
                load_start = time.time()
                log(f"load: {p.concurrency} users for {p.load_s:.0f}s")
                load.run(p.load_s)
                load_end = load_start + p.load_s
                drained = time.time()
                log(f"load over; requests drained {drained - load_end:.1f}s later")

                def at_min() -> bool:
                    dep = emu.get(APPS, "deployments", NS, NAME)
                    return bool(dep) and dep["spec"].get("replicas") == 1

                wait_until(at_min, p.window_s + 10 * p.interval_s + 30, "the scale-down to 1")
                time.sleep(p.settle_after_s)
            finally:
                done.set()
        events = _events(emu)
        log_text = operator.log.read_text(errors="replace")
    return {
        "params": asdict(p),
        "prometheus": True,
        "load_start": load_start,
        "load_end": load_end,
        "drained": drained,
        "samples": recorder.samples,
        "requests": [[r.start, r.end, r.ok] for r in load.records],
        "request_errors": [
            f"{r.start:.3f} {r.endpoint}: {r.error}" for r in load.records if not r.ok
        ],
        "events": events,
        "kubelet_errors": kubelet.errors,
        "operator_log_errors": [
            line for line in log_text.splitlines() if "Traceback" in line or "[ERROR" in line
        ],
    }
