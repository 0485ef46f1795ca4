"""An ``EndpointSource`` for Kubernetes: the ready endpoints of one Service's
EndpointSlices (label ``kubernetes.io/service-name``), listed every ``interval`` seconds
with the operator's API client (in-cluster service account or kubeconfig; credentials
reloaded on a 401). A list that fails keeps the last set. Listing, not watching: a few
slices per deployment make a list every few seconds cheap; a watch is the next step.
"""

from __future__ import annotations

import asyncio
import logging
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
    """``EndpointSliceSource("ml", "llama")``: the replicas behind Service ml/llama."""

    def __init__(
        self,
        namespace: str,
        service: str,
        port: int | str | None = None,
        interval: float = 2.0,
        client_factory: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.namespace = namespace
        self.service = service
        self.port = port
        self.interval = interval
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
        last: list[str] | None = None
        try:
            while True:
                try:
                    slices = await client.list(
                        self.path, label_selector=f"{SERVICE_LABEL}={self.service}"
                    )
                    urls = slice_urls(slices, self.port)
                    if urls != last:
                        log.info("endpoints of %s/%s: %s", self.namespace, self.service, urls)
                        update(urls)
                        last = urls
                except Exception as e:  # keep the last set; try again
                    log.warning("listing EndpointSlices failed: %r", e)
                await asyncio.sleep(self.interval)
        finally:
            await client.close()
