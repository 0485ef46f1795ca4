"""The autoscaler's Lease against the API emulator: one holder, take-over only after the
lease expired by the candidate's own clock, races decided by resourceVersion, release."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from kvscale.operator.kube import KubeClient
from kvscale.operator.leader import LEASES, LeaseLock, lease_name
from tests.k8s_emulator.runner import EmulatorThread

NS = "ml"
LLMD = {
    "apiVersion": "serving.kvscale.dev/v1alpha1",
    "kind": "LLMDeployment",
    "metadata": {"name": "demo", "namespace": NS, "uid": "uid-demo"},
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def emu() -> Iterator[EmulatorThread]:
    with EmulatorThread() as emu:
        emu.apply_yaml(f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n")
        yield emu


def _lease(emu: EmulatorThread) -> dict[str, Any]:
    lease = emu.get("coordination.k8s.io/v1", "leases", NS, lease_name("demo"))
    assert lease is not None
    return lease


def test_one_holder_and_take_over_after_expiry(emu: EmulatorThread) -> None:
    clock_a, clock_b = Clock(), Clock()

    async def run() -> None:
        api = KubeClient(emu.url)
        a, b = LeaseLock(api, "op-a", clock_a), LeaseLock(api, "op-b", clock_b)
        try:
            assert await a.acquire(LLMD, 6)
            assert not await b.acquire(LLMD, 6)
            clock_b.now += 5
            assert await a.acquire(LLMD, 6)  # renewed: b sees a new record
            assert not await b.acquire(LLMD, 6)
            clock_b.now += 5.9  # b has seen the same record for 5.9 s < 6 s
            assert not await b.acquire(LLMD, 6)
            clock_b.now += 0.2  # a stopped renewing 6.1 s ago by b's clock
            assert await b.acquire(LLMD, 6)
            assert not await a.acquire(LLMD, 6)  # a sees b's fresh record
        finally:
            await api.close()

    asyncio.run(run())
    lease = _lease(emu)
    assert lease["spec"]["holderIdentity"] == "op-b"
    assert lease["spec"]["leaseTransitions"] == 1 and lease["spec"]["leaseDurationSeconds"] == 6
    owner = lease["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-demo" and owner["controller"] is True  # deleted with the LLMD


def test_a_race_has_one_winner(emu: EmulatorThread) -> None:
    async def run() -> list[bool]:
        api_a, api_b = KubeClient(emu.url), KubeClient(emu.url)
        try:
            a, b = LeaseLock(api_a, "op-a"), LeaseLock(api_b, "op-b")
            first = await asyncio.gather(a.acquire(LLMD, 6), b.acquire(LLMD, 6))
            # The Lease is released: both try to take it at once again.
            holder = a if first[0] else b
            await holder.release(LLMD)
            second = await asyncio.gather(a.acquire(LLMD, 6), b.acquire(LLMD, 6))
            return [*first, *second]
        finally:
            await api_a.close()
            await api_b.close()

    results = asyncio.run(run())
    assert sorted(results[:2]) == [False, True]
    assert sorted(results[2:]) == [False, True]


def test_release_hands_over_at_once(emu: EmulatorThread) -> None:
    async def run() -> None:
        api = KubeClient(emu.url)
        a, b = LeaseLock(api, "op-a"), LeaseLock(api, "op-b")
        try:
            assert await a.acquire(LLMD, 45)
            await b.release(LLMD)  # not the holder: no effect
            assert not await b.acquire(LLMD, 45)
            await a.release(LLMD)
            assert "holderIdentity" not in _lease(emu)["spec"]
            assert await b.acquire(LLMD, 45)  # no 45 s wait after a release
        finally:
            await api.close()

    asyncio.run(run())
    assert _lease(emu)["spec"]["holderIdentity"] == "op-b"
    assert LEASES.path(NS, "x") == "/apis/coordination.k8s.io/v1/namespaces/ml/leases/x"
