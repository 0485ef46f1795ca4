"""Where the replicas come from, and what the router knows of each.

An ``EndpointSource`` reports the set of replica base URLs whenever it changes;
``StaticEndpoints`` reports a fixed list once (``--upstream``). A Kubernetes EndpointSlice
watcher would implement the same ``run`` (calling ``update`` on every change of the
deployment's ready addresses). ``Pool`` holds the replicas' state: readiness (polled from
``/ready``, and dropped at once on a refused connection), the requests the router has
in flight at each, and the load scraped from ``/metrics``
(``kvscale:num_requests_running`` + ``num_requests_waiting`` beyond those in flight
from this router, ``kvscale:kv_cache_usage_perc``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscale.router.balance import DEFAULT_VNODES, HashRing, Load

log = logging.getLogger("kvscale.router")

Update = Callable[[Sequence[str]], None]
NOT_READY_POLL_S = 0.5  # how often a replica out of the rotation is polled, at most


class EndpointSource(Protocol):
    """Reports the replicas' base URLs (``http://host:port``) through ``update``, first
    at start and then on every change; runs until cancelled (or returns, if the set
    never changes)."""

    async def run(self, update: Update) -> None: ...


class StaticEndpoints:
    """A fixed list (``kvscale route --upstream URL ...``)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]

    async def run(self, update: Update) -> None:
        update(self.urls)


@dataclass
class Replica:
    url: str
    ready: bool = False
    inflight: int = 0
    others: int = 0  # running + waiting it reported beyond our in-flight requests
    kv_usage: float = 0.0
    polled_at: float = 0.0

    def load(self) -> Load:
        return Load(self.inflight, self.others, self.kv_usage)


def parse_load(text: str) -> tuple[int, float]:
    """(requests running or waiting, KV-cache usage) from a replica's ``/metrics``."""
    count, kv = 0.0, 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name in ("kvscale:num_requests_waiting", "kvscale:num_requests_running"):
            count += sum(s.value for s in fam.samples)
        elif fam.name == "kvscale:kv_cache_usage_perc":
            kv = max((s.value for s in fam.samples), default=0.0)
    return int(count), float(kv)


class Pool:
    """The replicas, their ring, and a change signal for requests held while none is
    ready. ``on_ready_change(url, ready)`` is called on every transition."""

    def __init__(
        self,
        vnodes: int = DEFAULT_VNODES,
        on_ready_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.vnodes = vnodes
        self.replicas: dict[str, Replica] = {}
        self.ring = HashRing([], vnodes)
        self.changed = asyncio.Event()  # set (and replaced) whenever readiness changes
        self.on_ready_change = on_ready_change

    def update(self, urls: Sequence[str]) -> None:
        """The endpoint source's new set: new replicas start not ready (until polled),
        gone ones leave (requests in flight there finish)."""
        want = [u.rstrip("/") for u in urls]
        for u in want:
            self.replicas.setdefault(u, Replica(u))
        for u in list(self.replicas):
            if u not in want:
                self.set_ready(u, False)
                del self.replicas[u]
        self.ring = HashRing(list(self.replicas), self.vnodes)
        self._signal()

    def ready(self) -> dict[str, Load]:
        return {u: r.load() for u, r in self.replicas.items() if r.ready}

    def set_ready(self, url: str, ready: bool) -> None:
        r = self.replicas.get(url)
        if r is None or r.ready == ready:
            return
        r.ready = ready
        log.info("replica %s %s", url, "joined" if ready else "left the rotation")
        if self.on_ready_change is not None:
            self.on_ready_change(url, ready)
        self._signal()

    def _signal(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.changed.wait(), timeout)
        except TimeoutError:
            pass

    async def poll_one(self, client: httpx.AsyncClient, r: Replica, timeout: float) -> None:
        """``/ready``, then (if ready) ``/metrics``; any failure: not ready."""
        try:
            resp = await client.get(f"{r.url}/ready", timeout=timeout)
            ok = resp.status_code == 200
            if ok:
                mine = r.inflight
                m = await client.get(f"{r.url}/metrics", timeout=timeout)
                if m.status_code == 200:
                    reported, r.kv_usage = parse_load(m.text)
                    # ours may have finished or started meanwhile: subtract the larger
                    r.others = max(0, reported - max(mine, r.inflight))
        except (httpx.HTTPError, ValueError):
            ok = False
        r.polled_at = time.monotonic()
        if r.url in self.replicas:
            self.set_ready(r.url, ok)

    async def poll_forever(
        self, client: httpx.AsyncClient, interval: float, timeout: float = 5.0
    ) -> None:
        """Polls each ready replica every ``interval`` seconds, and each one out of the
        rotation more often (every NOT_READY_POLL_S at most), so that it rejoins soon
        after its /ready turns 200."""
        tick = min(interval, NOT_READY_POLL_S)
        while True:
            now = time.monotonic()
            due = [
                r
                for r in self.replicas.values()
                if now - r.polled_at >= (interval if r.ready else tick)
            ]
            if due:
                await asyncio.gather(*(self.poll_one(client, r, timeout) for r in due))
            await asyncio.sleep(tick)
