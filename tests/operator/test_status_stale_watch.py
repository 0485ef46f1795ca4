"""Two operator replicas, one whose Deployment watch lags: it writes an older ready count
over the other's newer one, and its next pass must correct it even though its watched
LLMDeployment copy (the other's write) already agrees with what it computes
(``kvscale.operator.status_writes``; CI saw READY stay at 2 of 3 with two operators)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvscale.operator.config import OperatorConfig
from kvscale.operator.kube import KubeClient
from kvscale.operator.reconcile import LLMDEPLOYMENTS, reconcile
from kvscale.operator.status_writes import StatusWrites
from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.harness import Kubectl, demo_llmd, install_crd_and_namespace

NS = "ml"
LLMD = demo_llmd("busy", NS, "  replicas: 3\n")
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/busy"


class Watched:
    """One operator's watches (a ``ChildCache``): the Deployment as last delivered."""

    def __init__(self, deployment: dict[str, Any]) -> None:
        self.deployment = deployment

    def child(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.deployment if kind == "Deployment" else None

    def pods(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return []

    def router(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None


def _ready(emu: EmulatorThread, ready: int) -> None:
    """The Deployment controller reports ``ready`` of 3 replicas."""
    status = {"replicas": 3, "updatedReplicas": 3, "readyReplicas": ready}
    emu.set_status("apps/v1", "deployments", NS, "busy", {**status, "availableReplicas": ready})


def _run(tmp_path: Path, writes: StatusWrites | None) -> tuple[int, int]:
    """Operator A writes ready 3; operator B, its Deployment watch one event behind, writes
    2; then B's watch delivers the Deployment at 3 while its LLMDeployment copy is still
    A's write. Returns (ready after B's stale pass, ready after B's next pass)."""
    config = OperatorConfig.from_env({})
    with EmulatorThread() as emu:
        kubectl = Kubectl(emu.write_kubeconfig(tmp_path / "admin", namespace=NS))
        install_crd_and_namespace(kubectl, NS)
        kubectl("apply", "-f", "-", input=LLMD)

        async def main() -> tuple[int, int]:
            api = KubeClient(emu.url)
            path = LLMDEPLOYMENTS.path(NS, "busy")

            async def ready() -> int:
                llmd = await api.get(path)
                assert llmd is not None
                return int(llmd["status"]["readyReplicas"])

            async def b_pass(watched: dict[str, Any], deployment: dict[str, Any]) -> None:
                llmd = watched
                if writes is not None:
                    fresh = await writes.current(api, NS, "busy", watched)
                    assert fresh is not None
                    llmd = dict(fresh)
                out = await reconcile(api, llmd, config, cache=Watched(deployment))
                if writes is not None:
                    writes.wrote(NS, "busy", out.status_version)

            try:
                first = await api.get(path)
                assert first is not None
                await reconcile(api, first, config)  # creates the Deployment
                _ready(emu, 2)
                at_2 = await api.get(DEPLOYMENT)
                _ready(emu, 3)
                at_3 = await api.get(DEPLOYMENT)
                assert at_2 is not None and at_3 is not None
                a_view = await api.get(path)
                assert a_view is not None
                out = await reconcile(api, a_view, config, cache=Watched(at_3))
                assert out.status_written and await ready() == 3
                b_view = await api.get(path)  # B's LLMDeployment watch has A's write
                assert b_view is not None
                await b_pass(b_view, at_2)  # ...its Deployment watch does not yet
                stale = await ready()
                await b_pass(b_view, at_3)  # the Deployment event; the same LLMD copy
                return stale, await ready()
            finally:
                await api.close()

        return asyncio.run(main())


def test_a_pass_after_its_own_status_write_diffs_against_a_fresh_read(tmp_path: Path) -> None:
    assert _run(tmp_path, StatusWrites()) == (2, 3)


def test_without_it_the_stale_count_stays(tmp_path: Path) -> None:
    """The failure ``StatusWrites`` prevents, shown: the watched copy agrees with the
    newer count, so the pass writes nothing and READY stays at 2."""
    assert _run(tmp_path, None) == (2, 2)
