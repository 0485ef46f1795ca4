"""The EndpointSlice source: which endpoints count, and the set following the slices of
a Service in the API emulator as they change."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

from kvscale.router.kube import EndpointSliceSource, slice_urls
from tests.k8s_emulator.runner import EmulatorThread

NS = "ml"


def _slice(name: str, service: str, endpoints: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
        "endpoints": endpoints,
    }


def _ep(addr: str, **conditions: bool) -> dict[str, Any]:
    return {"addresses": [addr], "conditions": conditions}


def test_slice_urls_keep_ready_endpoints_on_the_named_port() -> None:
    slices = [
        _slice("a", "llm", [_ep("10.0.0.1", ready=True), _ep("10.0.0.2", ready=False)]),
        _slice("b", "llm", [_ep("10.0.0.3"), _ep("10.0.0.4", ready=True, terminating=True)]),
        _slice("c", "llm", [_ep("fd00::5", ready=True)]),
    ]
    assert slice_urls(slices, "http") == [
        "http://10.0.0.1:8000", "http://10.0.0.3:8000", "http://[fd00::5]:8000",
    ]  # fmt: skip
    assert slice_urls(slices, None)[0] == "http://10.0.0.1:9000"  # the first port
    assert slice_urls(slices, 7000)[0] == "http://10.0.0.1:7000"
    assert slice_urls(slices, "nope") == []


def test_endpoints_follow_the_services_slices_in_the_api() -> None:
    from kvscale.operator.kube import KubeClient

    with EmulatorThread() as emu:
        emu.apply_yaml(f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n")
        path = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"

        async def main() -> list[list[str]]:
            seen: list[list[str]] = []
            api = KubeClient(emu.url)

            async def factory() -> KubeClient:
                return KubeClient(emu.url)

            async def wait_for(want: list[str]) -> None:
                for _ in range(200):
                    if seen and seen[-1] == want:
                        return
                    await asyncio.sleep(0.02)
                raise AssertionError(f"never saw {want}: {seen}")

            await api.create(path, _slice("llm-1", "llm", [_ep("10.0.0.1", ready=True)]))
            await api.create(path, _slice("other-1", "other", [_ep("10.0.0.9", ready=True)]))
            # changes arrive through the watch: no relist within the test (interval 60 s),
            # and each 1-second watch stream is resumed from its last version
            src = EndpointSliceSource(
                NS, "llm", "http", interval=60, client_factory=factory, watch_timeout_s=1
            )
            task = asyncio.create_task(src.run(lambda urls: seen.append(list(urls))))
            try:
                await wait_for(["http://10.0.0.1:8000"])
                # a second slice with one ready and one not-ready endpoint
                await api.create(
                    path,
                    _slice(
                        "llm-2", "llm", [_ep("10.0.0.2", ready=True), _ep("10.0.0.3", ready=False)]
                    ),
                )
                await wait_for(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
                # the first pod is terminating (scale-down), the third one became ready
                await api.replace(
                    f"{path}/llm-1",
                    {
                        **(await api.get(f"{path}/llm-1") or {}),
                        "endpoints": [_ep("10.0.0.1", ready=False, terminating=True)],
                    },
                )
                await api.replace(
                    f"{path}/llm-2",
                    {
                        **(await api.get(f"{path}/llm-2") or {}),
                        "endpoints": [_ep("10.0.0.2", ready=True), _ep("10.0.0.3", ready=True)],
                    },
                )
                await wait_for(["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
                await asyncio.sleep(1.5)  # past the first stream's end: a resumed watch
                await api.delete(f"{path}/llm-2")
                await wait_for([])
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await api.close()
            return seen

        seen = asyncio.run(asyncio.wait_for(main(), 60))
    assert all("10.0.0.9" not in u for urls in seen for u in urls)  # another Service's
    assert seen[0] == ["http://10.0.0.1:8000"]
    assert all(a != b for a, b in itertools.pairwise(seen))  # once per change
