"""An ``EndpointSource`` for Kubernetes: the ready endpoints of one Service's
EndpointSlices (label ``kubernetes.io/service-name``), listed and then watched with the
operator's API client (in-cluster service account or kubeconfig; credentials reloaded on
a 401), so that a pod that stops being ready leaves the rotation as soon as the
EndpointSlice controller says so. A failure keeps the last set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvscale.router.endpoints import Update

log = logging.getLogger("kvscale.router")

SERVICE_LABEL = "kubernetes.io/service-name"


def slice_urls(
    slices: list[dict[str, Any]], port: int | str | None, scheme: str = "http"
) -> list[str]:
    """``scheme://address:port`` of every endpoint that is not known to be unready or
    terminating (``ready`` unset counts as ready, as the API documents), one address per
    endpoint (its addresses are fungible). ``port``: a number, a port name of the slice,
    or None for the slice's first port."""
    urls: set[str] = set()
    for sl in slices:
        ports = sl.get("ports") or []
        if isinstance(port, int):
            num: int | None = port
        elif isinstance(port, str):
            num = next((p.get("port") for p in ports if p.get("name") == port), None)
        else:
            num = ports[0].get("port") if ports else None
        if num is None:
            continue
        for ep in sl.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            if cond.get("ready") is False or cond.get("terminating") is True:
                continue
            addrs = ep.get("addresses") or []
            if addrs:
                host = f"[{addrs[0]}]" if ":" in addrs[0] else addrs[0]
                urls.add(f"{scheme}://{host}:{num}")
    return sorted(urls)


def parse_port(text: str | None) -> int | str | None:
    if text is None:
        return None
    return int(text) if text.isdigit() else text


class EndpointSliceSource:
    """``EndpointSliceSource("ml", "llama")``: the replicas behind Service ml/llama, listed
    once and then watched (a slice's change reaches the router as the API server sends it);
    when the watch ends it resumes from the last version, and after an error (or a 410:
    the version is gone) it lists again ``interval`` seconds later. A failed list keeps
    the last set."""

    def __init__(
        self,
        namespace: str,
        service: str,
        port: int | str | None = None,
        interval: float = 2.0,
        client_factory: Callable[[], Awaitable[Any]] | None = None,
        watch_timeout_s: int = 300,
    ) -> None:
        self.namespace = namespace
        self.service = service
        self.port = port
        self.interval = interval
        self.watch_timeout_s = watch_timeout_s
        self._factory = client_factory

    @property
    def path(self) -> str:
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    async def run(self, update: Update) -> None:
        if self._factory is None:
            from kvscale.operator.kube import KubeClient

            client = await KubeClient.connect(user_agent="kvscale-router/0.1.0")
        else:
            client = await self._factory()
        selector = f"{SERVICE_LABEL}={self.service}"
        last: list[str] | None = None

        def publish(slices: dict[str, dict[str, Any]]) -> None:
            nonlocal last
            urls = slice_urls(list(slices.values()), self.port)
            if urls != last:
                log.info("endpoints of %s/%s: %s", self.namespace, self.service, urls)
                update(urls)
                last = urls

        try:
            while True:
                try:
                    items, version = await client.list_versioned(self.path, selector)
                    slices = {s["metadata"]["name"]: s for s in items}
                    publish(slices)
                    while True:  # watch until an error; each stream ends after a timeout
                        began = time.monotonic()
                        async for event in client.watch(
                            self.path, version, selector, self.watch_timeout_s
                        ):
                            kind, obj = event.get("type"), event.get("object") or {}
                            if kind == "ERROR":
                                raise RuntimeError(f"watch error: {obj.get('message', obj)}")
                            version = obj.get("metadata", {}).get("resourceVersion") or version
                            if kind in ("ADDED", "MODIFIED"):
                                slices[obj["metadata"]["name"]] = obj
                            elif kind == "DELETED":
                                slices.pop(obj["metadata"]["name"], None)
                            publish(slices)
                        if time.monotonic() - began < 1.0:  # ended at once: do not spin
                            await asyncio.sleep(min(1.0, self.interval))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # keep the last set; list and watch again
                    log.warning("listing or watching EndpointSlices failed: %r", e)
                await asyncio.sleep(self.interval)
        finally:
            await client.close()
