"""The operator's own Kubernetes API calls, on the official client's asyncio API
(``kubernetes.aio``) with its credential handling.

Kopf watches and patches the LLMDeployments itself; this client creates and updates the
children, reads pods and Secrets, and writes status, Leases and the scale subresource. It
sends plain dicts to resource paths (``ApiClient.param_serialize`` / ``call_api``) rather
than the generated typed APIs, so custom resources and built-ins go the same way.

Credentials stay fresh: in a pod, the in-cluster configuration re-reads the projected
service-account token (the kubelet rotates it about hourly; clusters that do not extend
its lifetime refuse the old one an hour later) every minute, and out of the cluster the
kubeconfig loader refreshes exec-plugin and OIDC tokens. Should the API server still
answer 401, the client loads its configuration again (a rotated token file, a changed
kubeconfig) and retries once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.aio import client as kclient
from kubernetes.aio import config as kconfig

log = logging.getLogger(__name__)
Obj = dict[str, Any]
USER_AGENT = "kvscale-operator/0.1.0"
Loader = Callable[[], Awaitable[kclient.Configuration]]


async def load_configuration() -> kclient.Configuration:
    """The in-cluster service account when running in a pod (``KUBERNETES_SERVICE_HOST``
    set), else the kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``), as kopf and kubectl
    choose. Raises ``kubernetes.aio.config.ConfigException`` when neither is there."""
    cfg = kclient.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        kconfig.load_incluster_config(client_configuration=cfg, try_refresh_token=True)
    else:
        await kconfig.load_kube_config(client_configuration=cfg, persist_config=False)
    return cfg


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
SERVICE_ACCOUNTS = Resource("v1", "serviceaccounts")
ROLES = Resource("rbac.authorization.k8s.io/v1", "roles")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io/v1", "rolebindings")
ENDPOINT_SLICES = Resource("discovery.k8s.io/v1", "endpointslices")
KINDS = {
    "Deployment": DEPLOYMENTS,
    "Service": SERVICES,
    "PodDisruptionBudget": PDBS,
    "ServiceAccount": SERVICE_ACCOUNTS,
    "Role": ROLES,
    "RoleBinding": ROLE_BINDINGS,
}


class ApiError(Exception):
    """An API call failed; ``status`` is the HTTP code, ``reason`` the Status reason."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class KubeClient:
    """REST verbs on resource paths. ``get`` returns None for 404; other failures raise
    ApiError. ``KubeClient(configuration, loader)``: ``loader`` builds a fresh
    configuration after a 401; ``KubeClient("http://host:port")``: no credentials."""

    def __init__(
        self,
        configuration: kclient.Configuration | str,
        loader: Loader | None = None,
        *,
        timeout: float = 30.0,
        user_agent: str = USER_AGENT,
    ) -> None:
        if isinstance(configuration, str):
            url, configuration = configuration, kclient.Configuration()
            configuration.host = url.rstrip("/")
        self.user_agent = user_agent
        self._loader = loader
        self._timeout = timeout
        self._api = self._client(configuration)
        self._relogin: asyncio.Lock | None = None

    def _client(self, configuration: kclient.Configuration) -> kclient.ApiClient:
        api = kclient.ApiClient(configuration)
        api.user_agent = self.user_agent
        return api

    @classmethod
    async def connect(cls, user_agent: str = USER_AGENT) -> KubeClient:
        """A client with the in-cluster or kubeconfig credentials (reloaded on 401)."""
        return cls(await load_configuration(), load_configuration, user_agent=user_agent)

    @property
    def server(self) -> str:
        return str(self._api.configuration.host)

    async def close(self) -> None:
        await self._api.close()

    async def _reload(self, stale: kclient.ApiClient) -> None:
        """Loads the configuration again (once for all the requests that got a 401)."""
        assert self._loader is not None
        self._relogin = self._relogin or asyncio.Lock()
        async with self._relogin:
            if self._api is not stale:  # another request already did it
                return
            log.info("the API server refused our credentials (401); loading them again")
            self._api = self._client(await self._loader())
        await stale.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        for attempt in (1, 2):
            api = self._api
            headers = {"Content-Type": content_type, "Accept": "application/json"}
            _, url, headers, body_out, _ = await api.param_serialize(
                method,
                path,
                query_params=list(params.items()) if params else None,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            rsp = await api.call_api(
                method, url, header_params=headers, body=body_out, _request_timeout=self._timeout
            )
            raw = await rsp.read()
            if rsp.status == 401 and attempt == 1 and self._loader is not None:
                await self._reload(api)
                continue
            text = raw.decode("utf-8", "replace") if raw else ""
            try:
                payload = json.loads(text) if text else {}
            except ValueError:
                payload = {"message": text}
            if rsp.status >= 400:
                reason = payload.get("reason") if isinstance(payload, dict) else None
                message = payload.get("message") if isinstance(payload, dict) else text
                raise ApiError(rsp.status, reason or str(rsp.reason or ""), message or text)
            return payload
        raise AssertionError("unreachable")

    async def get(self, path: str) -> Obj | None:
        try:
            return await self.request("GET", path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> list[Obj]:
        return (await self.list_versioned(path, label_selector))[0]

    async def list_versioned(
        self, path: str, label_selector: str | None = None
    ) -> tuple[list[Obj], str]:
        """The items and the list's resourceVersion (where a watch starts)."""
        params = {"labelSelector": label_selector} if label_selector else None
        payload = await self.request("GET", path, params=params)
        version = str((payload.get("metadata") or {}).get("resourceVersion") or "")
        return list(payload.get("items") or []), version

    async def watch(
        self,
        path: str,
        resource_version: str,
        label_selector: str | None = None,
        timeout_s: int = 300,
    ) -> AsyncIterator[Obj]:
        """The watch events (``{"type", "object"}``) of ``path`` after ``resource_version``
        until the server ends the stream (after about ``timeout_s``); bookmarks included.
        Raises ApiError when the watch is refused (410 Gone: list again)."""
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout_s),
        }
        if label_selector:
            params["labelSelector"] = label_selector
        api = self._api
        _, url, headers, _, _ = await api.param_serialize(
            "GET",
            path,
            query_params=list(params.items()),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        rsp = await api.call_api("GET", url, header_params=headers, _request_timeout=timeout_s + 30)
        try:
            if rsp.status == 401 and self._loader is not None:
                await self._reload(api)
            if rsp.status >= 400:
                text = (await rsp.read()).decode("utf-8", "replace")
                raise ApiError(rsp.status, str(rsp.reason or ""), text)
            while line := await rsp.response.content.readline():
                if line.strip():
                    yield json.loads(line)
        finally:
            rsp.response.release()

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
