"""A small asyncio Kubernetes API client (aiohttp) for the objects the operator owns.

Kopf watches and patches the LLMDeployments itself; this client creates and updates the
children. It logs in with the same credentials Kopf would use (in-cluster service account,
else kubeconfig), via ``kopf.login_with_service_account`` / ``kopf.login_with_kubeconfig``.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp

Obj = dict[str, Any]
USER_AGENT = "kvscale-operator/0.1.0"


@dataclass(frozen=True)
class Resource:
    """An API resource: ``Resource("apps/v1", "deployments")``."""

    api_version: str
    plural: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, sub: str | None = None
    ) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [root]
        if self.namespaced and namespace:
            parts += ["namespaces", namespace]
        parts.append(self.plural)
        if name:
            parts.append(name)
        if sub:
            parts.append(sub)
        return "/".join(parts)


DEPLOYMENTS = Resource("apps/v1", "deployments")
SERVICES = Resource("v1", "services")
PDBS = Resource("policy/v1", "poddisruptionbudgets")
SECRETS = Resource("v1", "secrets")
PODS = Resource("v1", "pods")
KINDS = {"Deployment": DEPLOYMENTS, "Service": SERVICES, "PodDisruptionBudget": PDBS}


class ApiError(Exception):
    """An API call failed; ``status`` is the HTTP code, ``reason`` the Status reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class KubeClient:
    """Minimal REST verbs. ``get`` returns None for 404; other failures raise ApiError."""

    def __init__(
        self,
        server: str,
        *,
        headers: dict[str, str] | None = None,
        ssl_context: ssl.SSLContext | bool | None = None,
        timeout: float = 30.0,
        user_agent: str = USER_AGENT,
    ) -> None:
        self.server = server.rstrip("/")
        self.user_agent = user_agent
        self._headers = headers or {}
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_connection_info(cls, info: Any, user_agent: str = USER_AGENT) -> KubeClient:
        """Build from a ``kopf.ConnectionInfo`` (what Kopf's login functions return)."""
        ctx = info.as_ssl_context() if info.server.startswith("https") else None
        return cls(
            info.server, headers=info.as_http_headers(), ssl_context=ctx, user_agent=user_agent
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        data = None if body is None else json.dumps(body)
        headers = {
            "Content-Type": content_type,
            "Accept": "application/json",
            "User-Agent": self.user_agent,
        }
        async with self._session.request(
            method, self.server + path, data=data, params=params, headers=headers, ssl=self._ssl
        ) as rsp:
            text = await rsp.text()
            payload = json.loads(text) if text else {}
            if rsp.status >= 400:
                reason = payload.get("reason") if isinstance(payload, dict) else None
                message = payload.get("message") if isinstance(payload, dict) else text
                raise ApiError(rsp.status, reason or rsp.reason or "", message or text)
            return payload

    async def get(self, path: str) -> Obj | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> list[Obj]:
        params = {"labelSelector": label_selector} if label_selector else None
        return list((await self.request("GET", path, params=params)).get("items") or [])

    async def create(self, path: str, body: Obj) -> Obj:
        return await self.request("POST", path, body=body)

    async def replace(self, path: str, body: Obj) -> Obj:
        return await self.request("PUT", path, body=body)

    async def patch(self, path: str, body: Obj) -> Obj:
        return await self.request(
            "PATCH", path, body=body, content_type="application/merge-patch+json"
        )

    async def delete(self, path: str) -> None:
        try:
            await self.request("DELETE", path, body={"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise
