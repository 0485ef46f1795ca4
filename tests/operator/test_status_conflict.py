"""A reconcile pass whose status write keeps conflicting (the autoscaler writing status
between each of its reads) raises Conflict after STATUS_ATTEMPTS writes, so the create /
update handler retries it, instead of leaving the status as it was."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvscale.operator.config import OperatorConfig
from kvscale.operator.kube import ApiError, KubeClient
from kvscale.operator.reconcile import LLMDEPLOYMENTS, STATUS_ATTEMPTS, Conflict, reconcile
from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.harness import Kubectl, demo_llmd, install_crd_and_namespace

NS = "ml"
LLMD = demo_llmd("busy", NS)


class StatusAlwaysChanged(KubeClient):
    """The emulator's API, except that every status patch meets a newer version."""

    status_writes = 0

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path.endswith("/status"):
            self.status_writes += 1
            raise ApiError(409, "Conflict", "the object has been modified")
        return await super().patch(path, body)


def test_a_status_write_that_always_conflicts_makes_the_pass_raise(tmp_path: Path) -> None:
    with EmulatorThread() as emu:
        kubectl = Kubectl(emu.write_kubeconfig(tmp_path / "admin", namespace=NS))
        install_crd_and_namespace(kubectl, NS)
        kubectl("apply", "-f", "-", input=LLMD)

        async def main() -> None:
            api = StatusAlwaysChanged(emu.url)
            try:
                llmd = await api.get(LLMDEPLOYMENTS.path(NS, "busy"))
                assert llmd is not None
                with pytest.raises(Conflict, match="status changed under each of"):
                    await reconcile(api, llmd, OperatorConfig.from_env({}))
                assert api.status_writes == STATUS_ATTEMPTS
                # the children were written all the same
                assert await api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/busy")
            finally:
                await api.close()

        asyncio.run(main())
