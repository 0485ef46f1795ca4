"""Leader election per autoscaled LLMDeployment with a ``coordination.k8s.io/v1`` Lease.

Two operator replicas (a rolling update, a second install, a developer's local operator) may
both run the autoscaler loop; only the holder of the Lease ``<name>-autoscaler`` (in the
LLMDeployment's namespace, owned by it so that it is garbage-collected with it) evaluates
and writes. Every write of the Lease carries its ``resourceVersion``, so of two candidates
exactly one wins (the other gets 409 Conflict).

As client-go's leader election does, expiry is judged by the local clock: a Lease held by
someone else is taken over only after its record has not changed for
``leaseDurationSeconds`` as seen here, so clock skew between the replicas does not matter.
A holder that stops releases the Lease (empty holder, duration 1 s) for a fast hand-over.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvscale.operator import render
from kvscale.operator.kube import ApiError, KubeClient, Resource

LEASES = Resource("coordination.k8s.io/v1", "leases")
LEASE_SUFFIX = "-autoscaler"


def micro_time(now: float | None = None) -> str:
    """A Kubernetes MicroTime: ``2026-01-01T00:00:00.000000Z``."""
    ts = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.UTC)
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_name(llmd_name: str) -> str:
    return f"{llmd_name}{LEASE_SUFFIX}"


@dataclass
class _Seen:
    record: tuple[Any, ...]  # (holder, renewTime, duration, transitions)
    at: float  # local monotonic seconds when the record last changed


class LeaseLock:
    """``await lock.acquire(llmd, duration_s)`` -> True while this identity leads."""

    def __init__(
        self, api: KubeClient, identity: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api = api
        self.identity = identity
        self._clock = clock
        self._seen: dict[tuple[str, str], _Seen] = {}

    def _body(self, llmd: Mapping[str, Any], duration_s: int, transitions: int) -> dict[str, Any]:
        meta = llmd["metadata"]
        now = micro_time()
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": lease_name(meta["name"]),
                "namespace": meta["namespace"],
                "labels": render.labels(meta["name"], "autoscaler"),
                "ownerReferences": [render.owner_reference(llmd)],
            },
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": duration_s,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    async def acquire(self, llmd: Mapping[str, Any], duration_s: int) -> bool:
        """Create, renew or take over the Lease; False when another live holder has it or
        another candidate won the race."""
        meta = llmd["metadata"]
        ns, name = meta["namespace"], lease_name(meta["name"])
        path = LEASES.path(ns, name)
        live = await self.api.get(path)
        if live is None:
            try:
                await self.api.create(LEASES.path(ns), self._body(llmd, duration_s, 0))
            except ApiError as e:
                if e.status == 409:
                    return False
                raise
            return True
        spec = live.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (
            holder,
            spec.get("renewTime"),
            spec.get("leaseDurationSeconds"),
            spec.get("leaseTransitions"),
        )
        now = self._clock()
        seen = self._seen.get((ns, name))
        if seen is None or seen.record != record:
            seen = self._seen[(ns, name)] = _Seen(record, now)
        expired = now - seen.at >= float(spec.get("leaseDurationSeconds") or 0)
        if holder and holder != self.identity and not expired:
            return False
        body = self._body(llmd, duration_s, int(spec.get("leaseTransitions") or 0))
        if holder == self.identity:
            body["spec"]["acquireTime"] = spec.get("acquireTime") or body["spec"]["acquireTime"]
        else:
            body["spec"]["leaseTransitions"] += 1
        body["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        try:
            await self.api.replace(path, body)
        except ApiError as e:
            if e.status == 409:
                return False
            raise
        return True

    async def release(self, llmd: Mapping[str, Any]) -> None:
        """Give the Lease up if this identity holds it (best effort)."""
        meta = llmd["metadata"]
        path = LEASES.path(meta["namespace"], lease_name(meta["name"]))
        live = await self.api.get(path)
        if live is None or (live.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        spec = dict(live["spec"])
        spec.pop("holderIdentity", None)
        spec.update(leaseDurationSeconds=1, renewTime=micro_time())
        body = {**live, "spec": spec}
        try:
            await self.api.replace(path, body)
        except ApiError as e:
            if e.status not in (404, 409):
                raise
