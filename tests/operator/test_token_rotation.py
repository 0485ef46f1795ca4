"""The operator's credentials survive a rotated service-account token (#14).

The kubelet rotates a pod's projected token about hourly, and clusters that do not extend
its lifetime refuse the old one an hour later. Here the emulator starts refusing the token
the operator started with, after the token file (``tokenFile`` in the kubeconfig, as the
projected file is in a pod) got a new one: both kopf's calls and the operator's own
(children, status) must go on working, and the emulator must have seen the old token
refused, so the test cannot pass without a rotation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import certifi
import pytest

from tests.k8s_emulator.runner import EmulatorThread
from tests.operator.harness import (
    Cluster,
    Kubectl,
    Operator,
    install_crd_and_namespace,
    wait_for,
)

NS = "ml"
LLMD = """apiVersion: serving.kvscale.dev/v1alpha1
kind: LLMDeployment
metadata: {{name: rot, namespace: ml}}
spec:
  model: {{source: builtin://demo}}
  engine: {{device: cpu, maxNumSeqs: {seqs}}}
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("rotation")
    token = workdir / "token"
    token.write_text("token-1")
    with EmulatorThread() as emu:
        emu.set_tokens(["token-1"])
        # kubectl is the cluster's admin (client-go sends no token over plain HTTP); the
        # operator reads its token from the file, as in a pod.
        kubectl = Kubectl(emu.write_kubeconfig(workdir / "admin", namespace=NS))
        kubeconfig = emu.write_kubeconfig(workdir / "kubeconfig", namespace=NS, token_file=token)
        install_crd_and_namespace(kubectl, NS)
        operator = Operator(kubeconfig, workdir)
        operator.start()
        try:
            yield Cluster(emu, kubectl, operator)
        except BaseException:
            print(operator.tail())
            raise
        finally:
            operator.stop()


def _args(cluster: Cluster) -> list[str]:
    dep = cluster.get("apps/v1", "deployments", NS, "rot") or {}
    return (
        (dep.get("spec") or {})
        .get("template", {})
        .get("spec", {})
        .get("containers", [{}])[0]
        .get("args", [])
    )


def test_a_rotated_token_under_a_running_operator(cluster: Cluster, tmp_path_factory) -> None:
    cluster.kubectl("apply", "-f", "-", input=LLMD.format(seqs=8))
    wait_for(lambda: "8" in _args(cluster), what="the Deployment")
    cluster.quiet()
    token = cluster.operator.workdir / "token"
    token.write_text("token-2")  # the kubelet writes the new token...
    cluster.emu.set_tokens(["token-2"])  # ... and the old one expires
    cluster.kubectl("apply", "-f", "-", input=LLMD.format(seqs=16))
    wait_for(lambda: "16" in _args(cluster), timeout=30, what="the Deployment updated")
    wait_for(
        lambda: (cluster.llmd(NS, "rot") or {}).get("status", {}).get("observedGeneration") == 2,
        timeout=30,
        what="the status written for generation 2",
    )
    refused = cluster.emu.refused
    agents = {agent.split("/")[0] for agent, _, _ in refused}
    assert "kvscale-operator" in agents, refused  # our client met the old token...
    after = [
        r
        for r in cluster.operator_requests()
        if r.headers.get("Authorization") == "Bearer token-2"
        and r.headers.get("User-Agent", "").startswith("kvscale-operator/")
    ]
    assert any(r.method.value == "PUT" for r in after)  # ... and then wrote with the new one
    assert "Traceback" not in cluster.operator.tail(400)


def test_in_cluster_credentials_are_read_again_after_a_401(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod: the service-account token file is what a 401 makes the client read again
    (the official client also re-reads it every minute by itself)."""
    import asyncio

    from kubernetes.aio.config import incluster_config

    from kvscale.operator import kube

    token, ca = tmp_path / "token", tmp_path / "ca.crt"  # type: ignore[operator]
    token.write_text("sa-1")
    ca.write_text(Path(certifi.where()).read_text())  # any valid PEM: nothing is sent
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")

    async def main() -> tuple[str | None, str | None, str]:
        api = await kube.KubeClient.connect()
        first = await api._api.configuration.get_api_key_with_prefix("BearerToken")
        token.write_text("sa-2")
        await api._reload(api._api)
        second = await api._api.configuration.get_api_key_with_prefix("BearerToken")
        server = api.server
        await api.close()
        return first, second, server

    first, second, server = asyncio.run(main())
    assert (first, second) == ("bearer sa-1", "bearer sa-2")
    assert server == "https://10.0.0.1:443"
