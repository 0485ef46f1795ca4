"""Real parts for the autoscaling tests and ``bench/autoscale_timeline.py``.

* :func:`ensure_prometheus` / :class:`PrometheusProcess`: the Debian ``prometheus`` server
  on loopback (installed with apt-get when missing), scraping every second.
* :class:`ServerProcesses`: ``kvscale serve`` processes standing in for pods, started with
  the very flags the operator renders for the LLMDeployment (host and port changed).
* :class:`FakeKubelet`: the Deployment controller, ReplicaSet and kubelet the emulator does
  not have. When the Deployment asks for N replicas, "pods" 0..N-1 exist and are Ready, each
  pointing at one already running server (pre-warmed: ready at once); the rest are deleted.
* :class:`LoadDriver`: the benchmark client's requests (:mod:`kvscale.bench_serve`) from a
  fixed number of concurrent users, spread round-robin over the ready pods like a Service.

How pods map to servers, honestly and simply: a pod ``<llmd>-<i>`` has ``podIP`` 127.0.0.1
and the annotation ``prometheus.io/port: <port of server i>`` (in a cluster every pod has
its own IP and port 8000). The operator scrapes that address itself when no Prometheus is
configured. Prometheus scrapes every server with a static target labelled
``namespace``/``pod``/``llmdeployment``, the labels that Kubernetes service discovery and the
chart's ServiceMonitor attach in a cluster, and the operator queries it by those labels for
the pods that are ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvscale import bench_serve
from kvscale.operator import constants as c
from tests.k8s_emulator.runner import EmulatorThread
from tests.ports import free_port

APPS = "apps/v1"
START_TIMEOUT_S = 120.0  # a few servers importing torch at once on 2 slow cores


def wait_until(fn: Callable[[], Any], timeout: float, what: str, period: float = 0.1) -> Any:
    """Poll ``fn`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


# --- Prometheus --------------------------------------------------------------------------------


def ensure_prometheus() -> str:
    """The ``prometheus`` binary; installs the Debian package (as root) when it is missing."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(
            "the prometheus server is missing: apt-get install -y prometheus (or make prometheus)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "prometheus"]):
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    found = shutil.which("prometheus")
    if not found:
        raise RuntimeError("apt-get installed prometheus but it is not on PATH")
    return found


@dataclass(frozen=True)
class ScrapeTarget:
    """One static target and the pod labels it stands for."""

    address: str  # 127.0.0.1:PORT
    namespace: str
    pod: str
    llmdeployment: str


class PrometheusProcess:
    """A real Prometheus on loopback with static targets, scraping every ``interval_s``."""

    def __init__(self, workdir: Path, targets: Sequence[ScrapeTarget], interval_s: int = 1):
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        scrape = f"{interval_s}s"
        config = {
            "global": {"scrape_interval": scrape, "scrape_timeout": scrape},
            "scrape_configs": [
                {
                    "job_name": "kvscale-servers",
                    "static_configs": [
                        {
                            "targets": [t.address],
                            "labels": {
                                "namespace": t.namespace,
                                "pod": t.pod,
                                "llmdeployment": t.llmdeployment,
                            },
                        }
                        for t in targets
                    ],
                }
            ],
        }
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._targets = len(targets)

    def start(self, timeout: float = 60.0) -> None:
        binary = ensure_prometheus()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )

        def targets_up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.log_path.read_text()[-2000:]}")
            try:
                result = self.query("up == 1")
            except (OSError, httpx.HTTPError):
                return False
            return len(result) == self._targets

        wait_until(targets_up, timeout, "Prometheus to scrape every target", period=0.25)

    def query(self, promql: str) -> list[dict[str, Any]]:
        rsp = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        rsp.raise_for_status()
        return rsp.json()["data"]["result"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


# --- kvscale serve processes -------------------------------------------------------------------


def loopback_args(args: Sequence[str], port: int) -> list[str]:
    """The rendered ``kvscale serve`` flags with the host and port of a loopback process."""
    out = list(args)
    out[out.index("--host") + 1] = "127.0.0.1"
    out[out.index("--port") + 1] = str(port)
    return out


class ServerProcesses:
    """``n`` ``kvscale serve`` processes with the same flags on free loopback ports."""

    def __init__(self, workdir: Path, args: Sequence[str], n: int) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.logs = [workdir / f"server-{i}.log" for i in range(n)]
        env = {
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PYTHONSAFEPATH": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",  # n processes share few cores
            "MKL_NUM_THREADS": "1",
        }
        self.procs = []
        for port, log in zip(self.ports, self.logs, strict=True):
            cmd = [sys.executable, "-m", "kvscale.cli", *loopback_args(args, port)]
            with open(log, "wb") as out:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
                )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        def ready() -> bool:
            for proc, url, log in zip(self.procs, self.urls, self.logs, strict=True):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()}")
                try:
                    if httpx.get(f"{url}/ready", timeout=2).status_code != 200:
                        return False
                except httpx.HTTPError:
                    return False
            return True

        wait_until(ready, timeout, "every kvscale serve process to be ready", period=0.5)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def read_metrics(url: str, timeout: float = 2.0) -> dict[str, float]:
    """The unlabelled view of a server's gauges: ``kvscale:kv_cache_usage_perc`` -> value."""
    text = httpx.get(f"{url}/metrics", timeout=timeout).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvscale:num_requests") or "kv_cache" in sample.name:
                out[sample.name] = sample.value
    return out


# --- the Deployment controller + kubelet -------------------------------------------------------


def pod_from_template(template: dict[str, Any], ns: str, name: str, port: int) -> dict[str, Any]:
    """A pod of a Deployment's ``template`` whose metrics are at 127.0.0.1:``port`` (the
    ``prometheus.io/port`` annotation; every test pod has podIP 127.0.0.1)."""
    meta = template.get("metadata") or {}
    notes = {**(meta.get("annotations") or {}), "prometheus.io/port": str(port)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": dict(meta.get("labels") or {}),
            "annotations": notes,
        },
        "spec": template.get("spec") or {},
    }


def write_deployment_status(
    emu: EmulatorThread, dep: dict[str, Any], replicas: int, ready: int, **extra: Any
) -> None:
    """The Deployment controller's status for ``replicas`` pods of which ``ready`` are
    ready (written only when it changed)."""
    status = {
        "observedGeneration": dep["metadata"].get("generation"),
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": ready,
        "availableReplicas": ready,
        **extra,
    }
    have = dep.get("status") or {}
    if any(have.get(k) != v for k, v in status.items()):
        meta = dep["metadata"]
        emu.set_status(APPS, "deployments", meta["namespace"], meta["name"], status)


class ControllerLoop:
    """Calls ``sync()`` every ``period`` seconds in a daemon thread between ``start()`` and
    ``stop()``; an exception is recorded in ``errors`` (tests check it) and the loop goes on,
    as a controller would."""

    def __init__(self, name: str, period: float = 0.2) -> None:
        self.period = period
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def sync(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=20)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as e:
                self.errors.append(repr(e))
            self._stop.wait(self.period)


class FakeKubelet(ControllerLoop):
    """Keeps pods ``<name>-0..N-1`` Ready for a Deployment of N replicas (N capped at the
    number of servers), deletes the others, and reports the Deployment's status."""

    def __init__(
        self, emu: EmulatorThread, namespace: str, name: str, ports: Sequence[int], period=0.2
    ) -> None:
        super().__init__("fake-kubelet", period)
        self.emu, self.ns, self.name, self.ports = emu, namespace, name, list(ports)
        self.ready: list[int] = []  # indexes of ready pods

    def pod_name(self, i: int) -> str:
        return f"{self.name}-{i}"

    def ready_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.ports[i]}" for i in list(self.ready)]

    def sync(self) -> None:
        """One pass: pods follow the Deployment's replicas, status follows the pods."""
        dep = self.emu.get(APPS, "deployments", self.ns, self.name)
        if dep is None:
            return
        n = min(int(dep["spec"].get("replicas", 1)), len(self.ports))
        for i in range(len(self.ports)):
            live = self.emu.get("v1", "pods", self.ns, self.pod_name(i))
            if i < n and live is None:
                pod = pod_from_template(
                    dep["spec"]["template"], self.ns, self.pod_name(i), self.ports[i]
                )
                self.emu.create("v1", "pods", self.ns, pod)
                self.emu.set_status(
                    "v1",
                    "pods",
                    self.ns,
                    self.pod_name(i),
                    {
                        "phase": "Running",
                        "podIP": "127.0.0.1",
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                )
            elif i >= n and live is not None:
                self.emu.delete("v1", "pods", self.ns, self.pod_name(i))
        self.ready = list(range(n))
        available = {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}
        write_deployment_status(self.emu, dep, n, n, conditions=[available])


# --- load ----------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    start: float  # time.time()
    end: float
    ok: bool
    endpoint: str
    error: str | None = None  # the benchmark client's reason, for a failed request


@dataclass
class LoadDriver:
    """``concurrency`` users, each sending the benchmark client's streaming completion
    requests back to back (``kvscale bench serve --request-rate inf --max-concurrency N``)
    until the load stops, to the ready pods in turn."""

    endpoints: Callable[[], list[str]]
    model: str
    concurrency: int = 12
    input_len: int = 80
    output_len: int = 48
    seed: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    in_flight: int = 0

    def run(self, duration_s: float, drain_timeout_s: float = 60.0) -> None:
        """Blocks for the load and until the requests in flight have finished."""
        asyncio.run(self._main(duration_s, drain_timeout_s))

    async def _main(self, duration_s: float, drain_timeout_s: float) -> None:
        lengths = bench_serve.sample_lengths(
            "random", 64, self.input_len, self.output_len, self.seed
        )
        requests = bench_serve.make_requests(lengths, self.seed)
        turn = itertools.count()
        deadline = time.monotonic() + duration_s
        async with bench_serve.client_session(self.concurrency * 2, 120.0) as client:

            async def user(u: int) -> None:
                for k in itertools.count():
                    if time.monotonic() >= deadline:
                        return
                    ready = self.endpoints()
                    if not ready:
                        await asyncio.sleep(0.1)
                        continue
                    base = ready[next(turn) % len(ready)]
                    req = requests[(u + k * self.concurrency) % len(requests)]
                    start = time.time()
                    self.in_flight += 1
                    try:
                        res = await bench_serve.send_request(client, base, self.model, req, None)
                    finally:
                        self.in_flight -= 1
                    self.records.append(
                        RequestRecord(start, time.time(), res.success, base, res.error)
                    )

            users = [asyncio.create_task(user(u)) for u in range(self.concurrency)]
            await asyncio.wait_for(asyncio.gather(*users), duration_s + drain_timeout_s)


# --- a running autoscaling setup -----------------------------------------------------------------


def llmd_manifest(name: str, namespace: str, autoscaling: dict[str, Any]) -> dict[str, Any]:
    """The LLMDeployment of these tests: the CPU demo model with a small KV pool."""
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"source": "builtin://demo", "maxModelLen": 512},
            "engine": {
                "device": "cpu",
                "maxNumSeqs": 4,
                "extraArgs": ["--num-kv-blocks", "32", "--disable-access-log"],
            },
            "autoscaling": {"enabled": True, **autoscaling},
        },
    }


@contextlib.contextmanager
def background(fn: Callable[[], None], name: str) -> Iterator[threading.Thread]:
    """Run ``fn`` in a daemon thread for the ``with`` block, then join it."""
    thread = threading.Thread(target=fn, name=name, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        thread.join(timeout=120)


# --- scale from zero: pods that start cold -------------------------------------------------------


class ColdStartKubelet(ControllerLoop):
    """The Deployment controller, kubelet and EndpointSlice controller for one LLMDeployment
    with ``spec.router``, starting real processes on demand:

    * the router Deployment: one ``kvscale route`` process with the rendered flags (host and
      port changed), reading EndpointSlices from the emulator through ``kubeconfig``; its
      pod is Ready once ``/health`` answers;
    * the server Deployment (0 or 1 replicas): a ``kvscale serve`` process started when it
      goes to 1 (a cold start: the pod is Ready, and in the ``<name>-replicas`` EndpointSlice,
      only once ``/ready`` answers) and killed when it goes to 0.
    """

    def __init__(
        self, emu: EmulatorThread, namespace: str, name: str, kubeconfig: Path, workdir: Path
    ) -> None:
        super().__init__("cold-kubelet")
        self.emu, self.ns, self.name = emu, namespace, name
        self.kubeconfig, self.workdir = kubeconfig, workdir
        self.router_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.router: subprocess.Popen[bytes] | None = None
        self.router_log = workdir / "router.log"
        self.server: ServerProcesses | None = None
        self.server_ready = False
        self.cold_starts = 0

    def stop(self) -> None:
        super().stop()
        if self.server is not None:
            self.server.stop()
        if self.router is not None and self.router.poll() is None:
            self.router.kill()
            self.router.wait(timeout=10)

    @staticmethod
    def _up(url: str, path: str) -> bool:
        try:
            return httpx.get(url + path, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def _pod(self, name: str, template: dict[str, Any], port: int) -> None:
        pod = pod_from_template(template, self.ns, name, port)
        self.emu.create("v1", "pods", self.ns, pod)
        self.emu.set_status("v1", "pods", self.ns, name, {"phase": "Pending"})

    def _set_ready(self, pod: str, ready: bool) -> None:
        status = {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        self.emu.set_status("v1", "pods", self.ns, pod, status)

    def _endpoints(self, port: int | None) -> None:
        """The ``<name>-replicas`` EndpointSlice: the ready server, or no endpoint."""
        slice_name = f"{self.name}-replicas-x1"
        if self.emu.get("discovery.k8s.io/v1", "endpointslices", self.ns, slice_name):
            self.emu.delete("discovery.k8s.io/v1", "endpointslices", self.ns, slice_name)
        self.emu.create(
            "discovery.k8s.io/v1",
            "endpointslices",
            self.ns,
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": slice_name,
                    "namespace": self.ns,
                    "labels": {"kubernetes.io/service-name": f"{self.name}-replicas"},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": port or 1, "protocol": "TCP"}],
                "endpoints": []
                if port is None
                else [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
            },
        )

    def sync(self) -> None:
        router_name = f"{self.name}-router"
        rdep = self.emu.get(APPS, "deployments", self.ns, router_name)
        if rdep is not None:
            self._sync_router(rdep, router_name)
        dep = self.emu.get(APPS, "deployments", self.ns, self.name)
        if dep is not None:
            self._sync_server(dep)

    def _sync_router(self, rdep: dict[str, Any], name: str) -> None:
        pod = f"{name}-0"
        if self.router is None:
            args = rdep["spec"]["template"]["spec"]["containers"][0]["args"]
            env = {
                **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                "PYTHONSAFEPATH": "1",
                "KUBECONFIG": str(self.kubeconfig),
            }
            cmd = [sys.executable, "-m", "kvscale.cli", *loopback_args(args, self.router_port)]
            with open(self.router_log, "wb") as out:
                self.router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            self._pod(pod, rdep["spec"]["template"], self.router_port)
        if self.router.poll() is not None:
            raise RuntimeError(f"the router exited:\n{self.router_log.read_text()[-2000:]}")
        live = self.emu.get("v1", "pods", self.ns, pod) or {}
        ready = any(x.get("status") == "True" for x in live.get("status", {}).get("conditions", []))
        if not ready and self._up(self.router_url, "/health"):
            self._set_ready(pod, True)
            ready = True
        write_deployment_status(self.emu, rdep, 1, int(ready))

    def _sync_server(self, dep: dict[str, Any]) -> None:
        pod = f"{self.name}-0"
        want = min(1, int(dep["spec"].get("replicas", 0)))
        if want and self.server is None:
            args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
            self.cold_starts += 1
            workdir = self.workdir / f"cold-{self.cold_starts}"
            workdir.mkdir()
            self.server = ServerProcesses(workdir, args, 1)
            self.server_ready = False
            self._pod(pod, dep["spec"]["template"], self.server.ports[0])
        elif not want and self.server is not None:
            self._endpoints(None)
            self.emu.delete("v1", "pods", self.ns, pod)
            self.server.stop()
            self.server, self.server_ready = None, False
        if self.server is not None and not self.server_ready:
            proc = self.server.procs[0]
            if proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.server.logs[0].read_text()[-2000:]}")
            if self._up(self.server.urls[0], "/ready"):
                self._set_ready(pod, True)
                self._endpoints(self.server.ports[0])
                self.server_ready = True
        n = 1 if self.server is not None else 0
        write_deployment_status(self.emu, dep, n, int(self.server_ready))
