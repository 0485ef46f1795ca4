"""The operator at scale: N LLMDeployments in the API emulator (CPU only, no cluster).

For each count N, a fresh emulator and a real operator (``kopf run``):

1. N LLMDeployments are created at once; the time from each create to its Deployment
   being written is recorded (the burst's median and p95).
2. The script plays the Deployment controller and the kubelet: one ready pod per
   Deployment, Deployment status ready; then waits until the operator is quiet.
3. Churn: every pod turns not ready and ready again (two pod events each, spread over
   ``--churn-seconds``), as probes flapping or a node blip would; the operator's API
   requests in that window give requests per minute, and per pod event.
4. Five more LLMDeployments are created one at a time while N exist: apply -> Deployment.

    python bench/operator_scale.py --counts 25 50 100 200 --out bench/results/operator_scale.json

The emulator keeps every request (kmock's log), so the operator's requests are counted
exactly (by User-Agent: kopf's and the operator's own client).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvscale.operator import constants as c  # noqa: E402
from tests.k8s_emulator.runner import EmulatorThread  # noqa: E402
from tests.operator.harness import Operator  # noqa: E402

NS = "scale"
LLMD_API = "serving.kvscale.dev/v1alpha1"


def llmd(name: str) -> dict[str, Any]:
    return {
        "apiVersion": LLMD_API,
        "kind": "LLMDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"source": "builtin://demo"}, "engine": {"device": "cpu"}},
    }


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-0",
            "namespace": NS,
            "labels": {c.OWNER_LABEL: name, c.MANAGED_BY_LABEL: c.MANAGER},
        },
        "spec": {"containers": [{"name": "server", "image": "kvscale-server:test"}]},
    }


def ready_status(ready: bool) -> dict[str, Any]:
    flag = "True" if ready else "False"
    return {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": flag},
            {"type": "PodScheduled", "status": "True"},
        ],
        "containerStatuses": [
            {"name": "server", "ready": ready, "restartCount": 0, "state": {"running": {}}}
        ],
    }


def operator_requests(emu: EmulatorThread, since: int = 0) -> list[Any]:
    reqs = emu.call(lambda: list(emu.api._requests[since:]))
    return [
        r
        for r in reqs
        if r.headers.get("User-Agent", "").startswith(("kopf/", "kvscale-operator/"))
        and r.params.get("watch") != "true"
    ]


def wait_deployments(emu: EmulatorThread, names: list[str], timeout: float) -> dict[str, float]:
    """When each Deployment was created (monotonic seconds, stamped by the emulator, so
    that polling costs the emulator nothing that grows with the count)."""
    deadline = time.monotonic() + timeout
    keys = [("deployments", NS, name) for name in names]
    while True:
        seen = emu.call(
            lambda: {k[2]: emu.api.created_at[k] for k in keys if k in emu.api.created_at}
        )
        if len(seen) == len(names):
            return seen
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(names) - len(seen)} Deployments never written")
        time.sleep(0.02)


def quiet(emu: EmulatorThread, seconds: float = 2.0, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        count = emu.call(lambda: len(emu.api._requests))
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return
        time.sleep(0.1)
    raise TimeoutError("the operator never went quiet")


def measure(n: int, churn_s: float, workdir: Path) -> dict[str, Any]:
    with EmulatorThread() as emu:
        kubeconfig = emu.write_kubeconfig(workdir / "kubeconfig", namespace=NS)
        emu.apply_yaml((ROOT / "crds" / "llmdeployments.serving.kvscale.dev.yaml").read_text())
        emu.apply_yaml(f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n")
        operator = Operator(kubeconfig, workdir)
        operator.start()
        try:
            names = [f"m{i:04d}" for i in range(n)]
            applied = {}
            for name in names:
                applied[name] = time.monotonic()
                emu.create(LLMD_API, "llmdeployments", NS, llmd(name))
            written = wait_deployments(emu, names, timeout=60 + n)
            burst = sorted(written[k] - applied[k] for k in names)
            for name in names:  # the Deployment controller and the kubelet
                emu.create("v1", "pods", NS, pod(name))
                emu.set_status("v1", "pods", NS, f"{name}-0", ready_status(True))
                emu.set_status(
                    "apps/v1",
                    "deployments",
                    NS,
                    name,
                    {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                     "readyReplicas": 1, "availableReplicas": 1},
                )  # fmt: skip
            quiet(emu)
            start = emu.call(lambda: len(emu.api._requests))
            t0 = time.monotonic()
            events = 0
            for k, ready in enumerate((False, True)):  # each half of the window: one pass
                for i, name in enumerate(names):
                    target = t0 + churn_s * (k + i / n) / 2
                    time.sleep(max(0.0, target - time.monotonic()))
                    emu.set_status("v1", "pods", NS, f"{name}-0", ready_status(ready))
                    events += 1
            quiet(emu)
            window = max(churn_s, time.monotonic() - t0)
            churn = operator_requests(emu, start)
            by_kind: dict[str, int] = {}
            for r in churn:
                key = f"{r.method.value} {r.resource.plural if r.resource else 'other'}"
                by_kind[key] = by_kind.get(key, 0) + 1
            singles = []
            for j in range(5):
                name = f"late{j}"
                t = time.monotonic()
                emu.create(LLMD_API, "llmdeployments", NS, llmd(name))
                singles.append(wait_deployments(emu, [name], 60)[name] - t)
                quiet(emu, 1.0)
        finally:
            operator.stop()
    return {
        "count": n,
        "burst_apply_to_deployment_s": {
            "median": statistics.median(burst),
            "p95": burst[int(0.95 * (len(burst) - 1))],
            "max": burst[-1],
        },
        "single_apply_to_deployment_s": {
            "median": statistics.median(singles),
            "max": max(singles),
        },
        "churn": {
            "pod_events": events,
            "seconds": round(window, 1),
            "operator_requests": len(churn),
            "requests_per_minute": round(60 * len(churn) / window, 1),
            "requests_per_pod_event": round(len(churn) / events, 2),
            "by_kind": by_kind,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[25, 50, 100, 200])
    p.add_argument("--churn-seconds", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--label", default="", help="stored with the results (e.g. before/after)")
    args = p.parse_args(argv)
    results = []
    for n in args.counts:
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(n, args.churn_seconds, Path(tmp))
        r["label"] = args.label
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
