"""A Kubernetes API server emulator on loopback, built on kmock.

kmock (by Kopf's author) gives the HTTP server, the request log and its filtering DSL
(``api["patch"]``, ``api[kmock.resource("apps", "v1", "deployments")]``), fault injection
with reactions (``api["post /api/v1/namespaces/x/services"] << 500``), the bundled
discovery data of a real cluster, and versioned object storage (``api.objects[...]`` keeps
every version of every object). kmock 0.8's own emulator is a merge-patching dict store;
this subclass replaces its request handling with what Kopf and kubectl need from a real API
server (see ``tests/k8s_emulator/README.md``). No controllers run: tests set the status of
Deployments and pods themselves.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import copy
import datetime
import json
import logging
import random
import string
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import rendering

from tests.k8s_emulator import jsonpath, patches
from tests.k8s_emulator.resources import ResourceType, builtin_types, crd_types
from tests.k8s_emulator.schema import Cause, RuleCompileError
from tests.k8s_emulator.selectors import (
    SelectorError,
    field_matcher,
    label_matcher,
    selector_from_label_selector,
)

log = logging.getLogger("k8s_emulator")
Obj = dict[str, Any]
BOOKMARK_INTERVAL = 2.0  # seconds between BOOKMARK events on idle watches


class ApiError(Exception):
    """Answered as a ``Status`` object with this code and reason."""

    def __init__(
        self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details


@dataclass(frozen=True)
class WatchEvent:
    rv: int
    key: tuple[str, str, str]  # group, version, plural
    type: str
    obj: Obj
    old: Obj | None


@dataclass(frozen=True)
class Route:
    """Where a request goes: discovery (no rtype), or a resource, an object, a subresource."""

    rtype: ResourceType | None
    namespace: str | None = None
    name: str | None = None
    sub: str | None = None


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _human_age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    then = datetime.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    secs = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    if secs < 120:
        return f"{max(secs, 0)}s"
    if secs < 7200:
        return f"{secs // 60}m"
    return f"{secs // 3600}h"


def _content(obj: Mapping[str, Any]) -> Obj:
    """What the generation tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _get_path(obj: Any, dotted: str) -> Any:
    for part in dotted.strip(".").split("."):
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(part)
    return obj


def _set_path(obj: Obj, dotted: str, value: Any) -> None:
    parts = dotted.strip(".").split(".")
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesScaffold):
    """The emulator. Enter it with ``kmock.Server`` (see :mod:`tests.k8s_emulator.runner`)."""

    types: dict[tuple[str, str, str], ResourceType] = attrs.field(factory=builtin_types)
    _objs: kmock.ObjectsArray = attrs.field(factory=kmock.ObjectsArray, init=False)
    _rv: int = attrs.field(default=1, init=False)
    _log: list[WatchEvent] = attrs.field(factory=list, init=False)
    _log_rvs: list[int] = attrs.field(factory=list, init=False)
    _changed: asyncio.Event | None = attrs.field(default=None, init=False)
    # Bearer tokens accepted (None: any request is authenticated); requests with another
    # token get 401, as a real API server answers a rotated-out service-account token.
    tokens: set[str] | None = attrs.field(default=None, init=False)
    refused: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    # When each object was created (monotonic seconds), for measurements.
    created_at: dict[tuple[str, str, str], float] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        # kmock's scaffold registers discovery fallbacks; this server answers them itself.
        for name in ("default", "kube-system", "kube-public"):
            self._store(
                self.types[("", "v1", "namespaces")], None, name, self._new_namespace(name), "ADDED"
            )

    # --- state --------------------------------------------------------------------------------

    @property
    def objects(self) -> kmock.ObjectsArray:
        """Every object and its versions: ``api.objects["apps/v1/deployments", "ns", "x"]``."""
        return self._objs

    @property
    def resource_version(self) -> int:
        return self._rv

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _key(self, rtype: ResourceType, ns: str | None, name: str):
        return (rtype.kmock_resource, ns if rtype.namespaced else None, name)

    def get_object(self, rtype: ResourceType, ns: str | None, name: str) -> Obj | None:
        key = self._key(rtype, ns, name)
        if key not in self._objs or self._objs[key].deleted:
            return None
        return copy.deepcopy(self._objs[key].raw)

    def _iter(self, rtype: ResourceType | None = None, ns: str | None = None):
        for (res, obj_ns, _name), obj in list(self._objs.items()):
            if obj.deleted:
                continue
            if rtype is not None and (res.group, res.version, res.plural) != rtype.key:
                continue
            if ns is not None and obj_ns != ns:
                continue
            yield self.types.get((res.group, res.version, res.plural)), copy.deepcopy(obj.raw)

    def _store(
        self,
        rtype: ResourceType,
        ns: str | None,
        name: str,
        obj: Obj | None,
        event: str,
        old: Obj | None = None,
    ):
        """Write (or with ``obj=None`` remove) an object, recording a watch event."""
        key = self._key(rtype, ns, name)
        if obj is None:
            assert old is not None
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = self._next_rv()
            self._objs[key].delete()
            self._record(rtype, "DELETED", gone, old)
            return
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        if key in self._objs:
            self._objs[key].create(obj) if self._objs[key].deleted else self._objs[
                key
            ].history.append(obj)
        else:
            self._objs[key] = obj
        self._record(rtype, event, obj, old)

    def _record(self, rtype: ResourceType, type_: str, obj: Obj, old: Obj | None) -> None:
        event = WatchEvent(
            int(obj["metadata"]["resourceVersion"]),
            rtype.key,
            type_,
            self._with_kind(rtype, obj),
            old,
        )
        self._log.append(event)
        self._log_rvs.append(event.rv)
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    def _with_kind(self, rtype: ResourceType, obj: Obj) -> Obj:
        return {
            "apiVersion": rtype.api_version,
            "kind": rtype.kind,
            **{k: v for k, v in obj.items() if k not in ("apiVersion", "kind")},
        }

    def _new_namespace(self, name: str) -> Obj:
        return {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "creationTimestamp": now_rfc3339(),
                "labels": {"kubernetes.io/metadata.name": name},
            },
            "spec": {"finalizers": ["kubernetes"]},
            "status": {"phase": "Active"},
        }

    # --- HTTP entry point ---------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kubectl (client-go) sends no bearer token over plain HTTP: it is the admin here.
        if self.tokens is not None and not raw.headers.get("User-Agent", "").startswith("kubectl/"):
            scheme, _, token = raw.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token.strip() not in self.tokens:
                agent = raw.headers.get("User-Agent", "")
                self.refused.append((agent, raw.method, raw.path))
                return self._status(ApiError(401, "Unauthorized", "Unauthorized"))
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        try:
            route = self._route(raw.path)
        except ApiError as e:
            return self._status(e)
        action = self._action(raw.method, route, dict(raw.query))
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw,
            url=raw.url,
            method=raw.method,
            params=dict(raw.query),
            headers=dict(raw.headers),
            cookies=dict(raw.cookies),
            data=data,
            body=body,
            text=body.decode("utf-8", "replace"),
            action=action,
            resource=route.rtype.kmock_resource if route.rtype else None,
            namespace=route.namespace,
            name=route.name,
            subresource=route.sub,
        )
        self._requests.append(request)
        try:
            return await self._handle(request, route)
        except ApiError as e:
            return self._status(e)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug in the emulator: say so like an API server would
            log.exception("emulator failure on %s %s", raw.method, raw.path)
            return self._status(ApiError(500, "InternalError", f"emulator failure: {e!r}"))

    async def _handle(
        self, request: rendering.Request, route: Route | None = None
    ) -> aiohttp.web.StreamResponse:  # type: ignore[override]
        # Reactions that tests register (fault injection) win over the emulation.
        if any(request in p._source and not p._disabled.is_set() for p in self._payloads):
            try:
                return await super()._handle(request)
            except NotImplementedError:
                pass
        assert route is not None
        return await self._serve(request, route)

    def _status(self, e: ApiError) -> aiohttp.web.Response:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": e.message,
            "reason": e.reason,
            "code": e.code,
        }
        if e.details:
            body["details"] = dict(e.details)
        return aiohttp.web.json_response(body, status=e.code)

    def _route(self, path: str) -> Route:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return Route(None)
        if not rest:
            return Route(None)
        ns = None
        if rest[0] == "namespaces" and len(rest) >= 3 and (group, version, rest[2]) in self.types:
            ns, rest = rest[1], rest[2:]
        rtype = self.types.get((group, version, rest[0]))
        if rtype is None:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({path})"
            )
        name = rest[1] if len(rest) > 1 else None
        sub = "/".join(rest[2:]) or None
        return Route(rtype, ns, name, sub)

    @staticmethod
    def _action(method: str, route: Route, query: Mapping[str, str]) -> kmock.action | None:
        if route.rtype is None:
            return None
        if method == "GET":
            if query.get("watch") in ("true", "1"):
                return kmock.action.WATCH
            return kmock.action.FETCH if route.name else kmock.action.LIST
        return {
            "POST": kmock.action.CREATE,
            "PATCH": kmock.action.UPDATE,
            "DELETE": kmock.action.DELETE,
        }.get(method)

    async def _serve(self, request: rendering.Request, route: Route) -> aiohttp.web.StreamResponse:
        method, params = request.method.value, request.params
        if "protobuf" in request.headers.get("Content-Type", ""):
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the emulator speaks JSON only, not protobuf "
                "(use kubectl apply -f for built-in kinds)",
            )
        if route.rtype is None:
            return self._discovery(request)
        rtype = route.rtype
        if route.sub and route.sub not in rtype.subresources:
            raise ApiError(404, "NotFound", f"{rtype.plural} has no subresource {route.sub}")
        if method == "GET" and params.get("watch") in ("true", "1"):
            return await self._watch(request, route)
        if method == "GET" and route.name is None:
            return self._respond(
                request, rtype, self._list(rtype, route.namespace, params), listing=True
            )
        if method == "GET":
            obj = self._must_get(rtype, route.namespace, route.name)
            if route.sub == "scale":
                return aiohttp.web.json_response(self._scale_view(rtype, obj))
            return self._respond(request, rtype, obj)
        if method == "POST" and route.name is None:
            return aiohttp.web.json_response(
                self._create(rtype, route.namespace, request.data, params), status=201
            )
        if method == "PUT" and route.name:
            return aiohttp.web.json_response(self._update(rtype, route, request.data, params))
        if method == "PATCH" and route.name:
            ctype = request.headers.get("Content-Type", "")
            if ctype.startswith(patches.APPLY):
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "server-side apply is not emulated; use client-side kubectl apply",
                )
            return aiohttp.web.json_response(self._patch(rtype, route, ctype, request.data, params))
        if method == "DELETE" and route.name:
            return aiohttp.web.json_response(
                self._delete(rtype, route.namespace, route.name, request.data or {}, params)
            )
        if method == "DELETE":
            return aiohttp.web.json_response(
                self._delete_collection(rtype, route.namespace, params)
            )
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {request.url.path}")

    # --- discovery ----------------------------------------------------------------------------

    def _discovery(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        if path in ("/healthz", "/livez", "/readyz"):
            return aiohttp.web.Response(text="ok")
        if path.startswith("/openapi/v3"):
            return self._openapi(path)
        if path == "/version":
            return aiohttp.web.json_response(
                {
                    "major": "1",
                    "minor": "34",
                    "gitVersion": "v1.34.0-kvscale-emulator",
                    "platform": "linux/amd64",
                }
            )
        if path == "/api":
            host = request.url.host or "127.0.0.1"
            return aiohttp.web.json_response(
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{host}:{request.url.port}"}
                    ],
                }
            )
        groups: dict[str, list[str]] = {}
        for group, version, _ in self.types:
            if group and version not in groups.setdefault(group, []):
                groups[group].append(version)
        if path == "/apis":
            return aiohttp.web.json_response(
                {
                    "kind": "APIGroupList",
                    "apiVersion": "v1",
                    "groups": [self._group(g, vs) for g, vs in sorted(groups.items())],
                }
            )
        parts = [p for p in path.split("/") if p]
        if len(parts) == 2 and parts[0] == "apis" and parts[1] in groups:
            return aiohttp.web.json_response(
                {"kind": "APIGroup", "apiVersion": "v1", **self._group(parts[1], groups[parts[1]])}
            )
        if parts == ["api", "v1"] or (
            len(parts) == 3 and parts[0] == "apis" and parts[2] in groups.get(parts[1], [])
        ):
            group, version = ("", "v1") if parts[0] == "api" else (parts[1], parts[2])
            return aiohttp.web.json_response(self._resource_list(group, version))
        raise ApiError(
            404, "NotFound", f"the server could not find the requested resource ({path})"
        )

    def _openapi(self, path: str) -> aiohttp.web.Response:
        """Just enough OpenAPI v3 for kubectl to see that the server validates fields itself
        (``fieldValidation=Strict`` on PATCH), so it never needs schemas to validate locally."""
        gvs = sorted({(t.group, t.version) for t in self.types.values()})

        def gv_path(g: str, v: str) -> str:
            return f"apis/{g}/{v}" if g else f"api/{v}"

        if path == "/openapi/v3":
            return aiohttp.web.json_response(
                {
                    "paths": {
                        gv_path(g, v): {
                            "serverRelativeURL": f"/openapi/v3/{gv_path(g, v)}?hash={self._rv}"
                        }
                        for g, v in gvs
                    }
                }
            )
        paths = {}
        for t in self.types.values():
            if f"/openapi/v3/{gv_path(t.group, t.version)}" != path:
                continue
            ns = "/namespaces/{namespace}" if t.namespaced else ""
            paths[f"/{gv_path(t.group, t.version)}{ns}/{t.plural}/{{name}}"] = {
                "patch": {
                    "parameters": [
                        {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}
                    ],
                    "x-kubernetes-group-version-kind": {
                        "group": t.group,
                        "version": t.version,
                        "kind": t.kind,
                    },
                    "responses": {},
                }
            }
        if not paths:
            raise ApiError(404, "NotFound", f"no OpenAPI document at {path}")
        return aiohttp.web.json_response(
            {
                "openapi": "3.0.0",
                "info": {"title": "Kubernetes", "version": "v1.34.0"},
                "paths": paths,
                "components": {"schemas": {}},
            }
        )

    @staticmethod
    def _group(group: str, versions: list[str]) -> Obj:
        pref = sorted(
            versions, key=lambda v: (not v.startswith("v1"), "beta" in v or "alpha" in v, v)
        )[0]
        return {
            "name": group,
            "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
            "preferredVersion": {"groupVersion": f"{group}/{pref}", "version": pref},
        }

    def _resource_list(self, group: str, version: str) -> Obj:
        resources = []
        for rtype in self.types.values():
            if (rtype.group, rtype.version) != (group, version):
                continue
            entry = {
                "name": rtype.plural,
                "singularName": rtype.singular,
                "namespaced": rtype.namespaced,
                "kind": rtype.kind,
                "verbs": rtype.verbs,
            }
            if rtype.short_names:
                entry["shortNames"] = rtype.short_names
            if rtype.categories:
                entry["categories"] = rtype.categories
            resources.append(entry)
            for sub in sorted(rtype.subresources):
                sub_entry = {
                    "name": f"{rtype.plural}/{sub}",
                    "singularName": "",
                    "namespaced": rtype.namespaced,
                    "kind": rtype.kind,
                    "verbs": ["get", "patch", "update"],
                }
                if sub == "scale":
                    sub_entry.update(kind="Scale", group="autoscaling", version="v1")
                resources.append(sub_entry)
        gv = f"{group}/{version}" if group else version
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": gv,
            "resources": resources,
        }

    # --- reads --------------------------------------------------------------------------------

    def _must_get(self, rtype: ResourceType, ns: str | None, name: str) -> Obj:
        obj = self.get_object(rtype, ns, name)
        if obj is None:
            raise ApiError(
                404,
                "NotFound",
                f'{self._kind_ref(rtype)} "{name}" not found',
                {"name": name, "group": rtype.group, "kind": rtype.plural},
            )
        return self._with_kind(rtype, obj)

    @staticmethod
    def _kind_ref(rtype: ResourceType) -> str:
        return f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural

    def _matchers(self, params: Mapping[str, str]):
        try:
            return label_matcher(params.get("labelSelector")), field_matcher(
                params.get("fieldSelector")
            )
        except SelectorError as e:
            raise ApiError(400, "BadRequest", str(e)) from e

    def _list(self, rtype: ResourceType, ns: str | None, params: Mapping[str, str]) -> Obj:
        labels, fields = self._matchers(params)
        items = [
            self._with_kind(rtype, obj)
            for _, obj in self._iter(rtype, ns if rtype.namespaced else None)
            if labels(obj) and fields(obj)
        ]
        items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
        meta: Obj = {"resourceVersion": str(self._rv)}
        start = 0
        if params.get("continue"):
            start = int(json.loads(base64.b64decode(params["continue"]))["start"])
        limit = int(params.get("limit") or 0)
        if limit and start + limit < len(items):
            meta["continue"] = base64.b64encode(
                json.dumps({"start": start + limit}).encode()
            ).decode()
            meta["remainingItemCount"] = len(items) - start - limit
        items = items[start : start + limit] if limit else items[start:]
        return {
            "kind": f"{rtype.kind}List",
            "apiVersion": rtype.api_version,
            "metadata": meta,
            "items": items,
        }

    def _respond(
        self, request: rendering.Request, rtype: ResourceType, payload: Obj, listing: bool = False
    ) -> aiohttp.web.Response:
        accept = request.headers.get("Accept", "")
        if "as=Table" in accept:
            rows = payload["items"] if listing else [payload]
            return aiohttp.web.json_response(self._table(rtype, rows))
        return aiohttp.web.json_response(payload)

    def _table(self, rtype: ResourceType, objs: list[Obj]) -> Obj:
        """Server-side printing (``kubectl get``): the CRD's printer columns, else Name/Age."""
        columns = [
            {
                "name": "Name",
                "type": "string",
                "format": "name",
                "description": "Name",
                "priority": 0,
            }
        ]
        paths = []
        cols = rtype.printer_columns or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
        ]
        for col in cols:
            columns.append(
                {
                    "name": col["name"],
                    "type": "string" if col.get("type") == "date" else col.get("type", "string"),
                    "format": col.get("format", ""),
                    "description": col.get("description", ""),
                    "priority": col.get("priority", 0),
                }
            )
            paths.append(col)
        rows = []
        for obj in objs:
            cells: list[Any] = [obj["metadata"]["name"]]
            for col in paths:
                values = jsonpath.evaluate(col["jsonPath"], obj)
                value = values[0] if values else None
                if col.get("type") == "date":
                    value = _human_age(value) if value else "<unknown>"
                cells.append(value)
            rows.append({"cells": cells, "object": obj})
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(self._rv)},
            "columnDefinitions": columns,
            "rows": rows,
        }

    def _scale_view(self, rtype: ResourceType, obj: Obj) -> Obj:
        assert rtype.scale is not None
        meta = obj["metadata"]
        if rtype.scale.get("labelSelectorPath"):
            selector = _get_path(obj, rtype.scale["labelSelectorPath"]) or ""
        else:
            selector = selector_from_label_selector(_get_path(obj, ".spec.selector"))
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": _get_path(obj, rtype.scale["specReplicasPath"]) or 0},
            "status": {
                "replicas": _get_path(obj, rtype.scale["statusReplicasPath"]) or 0,
                "selector": selector,
            },
        }

    # --- watches ------------------------------------------------------------------------------

    async def _watch(self, request: rendering.Request, route: Route) -> aiohttp.web.StreamResponse:
        rtype, params = route.rtype, request.params
        assert rtype is not None
        labels, fields = self._matchers(params)
        ns = route.namespace if rtype.namespaced else None

        def visible(obj: Obj | None) -> bool:
            if obj is None:
                return False
            meta = obj.get("metadata", {})
            if ns is not None and meta.get("namespace") != ns:
                return False
            if route.name is not None and meta.get("name") != route.name:
                return False
            return labels(obj) and fields(obj)

        rsp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await rsp.prepare(request._raw_request)
        loop = asyncio.get_running_loop()
        timeout = float(params.get("timeoutSeconds") or 1800)
        deadline = loop.time() + timeout
        bookmarks = params.get("allowWatchBookmarks") == "true"
        since = params.get("resourceVersion")
        initial = params.get("sendInitialEvents") == "true"

        async def send(type_: str, obj: Obj) -> None:
            await rsp.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

        try:
            if since in (None, "", "0") or initial:
                cursor = self._rv
                for _, obj in self._iter(rtype, ns):
                    if visible(obj):
                        await send("ADDED", self._with_kind(rtype, obj))
                if initial and bookmarks:
                    mark = {
                        "kind": rtype.kind,
                        "apiVersion": rtype.api_version,
                        "metadata": {
                            "resourceVersion": str(cursor),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    }
                    await send("BOOKMARK", mark)
            else:
                cursor = int(since)
                if self._log_rvs and cursor < self._log_rvs[0] - 1:
                    await send(
                        "ERROR",
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "code": 410,
                            "reason": "Expired",
                            "message": f"too old resource version: {cursor}",
                        },
                    )
                    return rsp
            pos = bisect.bisect_right(self._log_rvs, cursor)
            while True:
                while pos < len(self._log):
                    ev = self._log[pos]
                    pos += 1
                    if ev.key != rtype.key:
                        continue
                    now_in, was_in = visible(ev.obj), visible(ev.old)
                    if ev.type == "DELETED" and was_in:
                        await send("DELETED", ev.obj)
                    elif ev.type == "ADDED" and now_in:
                        await send("ADDED", ev.obj)
                    elif ev.type == "MODIFIED" and now_in:
                        await send("MODIFIED" if was_in else "ADDED", ev.obj)
                    elif ev.type == "MODIFIED" and was_in:
                        await send("DELETED", ev.obj)  # it left the selector
                left = deadline - loop.time()
                if left <= 0:
                    break
                changed = self._changed or asyncio.Event()
                self._changed = changed
                try:
                    await asyncio.wait_for(changed.wait(), timeout=min(left, BOOKMARK_INTERVAL))
                except TimeoutError:
                    if bookmarks:
                        await send(
                            "BOOKMARK",
                            {
                                "kind": rtype.kind,
                                "apiVersion": rtype.api_version,
                                "metadata": {"resourceVersion": str(self._rv)},
                            },
                        )
            await rsp.write_eof()
        except (ConnectionResetError, ConnectionError, RuntimeError):
            pass  # the client went away
        return rsp

    # --- writes -------------------------------------------------------------------------------

    def _check_namespace(self, rtype: ResourceType, ns: str | None) -> None:
        if rtype.namespaced:
            if not ns:
                raise ApiError(400, "BadRequest", "the namespace of the object is required")
            if self.get_object(self.types[("", "v1", "namespaces")], None, ns) is None:
                raise ApiError(
                    404,
                    "NotFound",
                    f'namespaces "{ns}" not found',
                    {"name": ns, "kind": "namespaces"},
                )

    def _validate_custom(
        self, rtype: ResourceType, obj: Obj, old: Obj | None, params: Mapping[str, str]
    ) -> Obj:
        """Prune or refuse unknown fields, default, then validate schema and CEL rules."""
        if rtype.schema is None:
            return obj
        pruned, unknown = rtype.schema.prune(obj)
        name = obj.get("metadata", {}).get("name") or obj.get("metadata", {}).get(
            "generateName", ""
        )
        if unknown and params.get("fieldValidation") == "Strict":
            fields = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise ApiError(
                400,
                "BadRequest",
                f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: '
                f"strict decoding error: {fields}",
            )
        defaulted = rtype.schema.default(pruned)
        causes = rtype.schema.validate(defaulted, old)
        if causes:
            self._invalid(rtype, name, causes)
        return defaulted

    def _invalid(
        self,
        rtype: ResourceType,
        name: str,
        causes: list[Cause],
        code: int = 422,
        reason: str = "Invalid",
    ) -> None:
        text = (
            "; ".join(str(c) for c in causes)
            if len(causes) == 1
            else "[" + ", ".join(str(c) for c in causes) + "]"
        )
        raise ApiError(
            code,
            reason,
            f'{rtype.kind}.{rtype.group or "core"} "{name}" is invalid: {text}',
            {
                "name": name,
                "group": rtype.group,
                "kind": rtype.kind,
                "causes": [
                    {"reason": c.reason, "message": c.message, "field": c.field} for c in causes
                ],
            },
        )

    def _default_builtin(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> Obj:
        """The few server defaults our tests look at."""
        spec = (
            obj.setdefault("spec", {})
            if rtype.kind in ("Deployment", "Service", "PodDisruptionBudget")
            else None
        )
        if rtype.kind == "Deployment":
            spec.setdefault("replicas", 1)
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("progressDeadlineSeconds", 600)
        if rtype.kind == "Service":
            spec.setdefault("type", "ClusterIP")
            if spec.get("type") != "ExternalName" and "clusterIP" not in spec:
                ip = (old or {}).get("spec", {}).get(
                    "clusterIP"
                ) or f"10.96.{random.randint(0, 255)}.{random.randint(1, 254)}"
                spec["clusterIP"], spec["clusterIPs"] = ip, [ip]
            for port in spec.get("ports") or ():
                port.setdefault("protocol", "TCP")
        if rtype.kind == "Namespace":
            obj.setdefault("status", {"phase": "Active"})
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj[
                "metadata"
            ]["name"]
        if rtype.kind == "Pod":
            obj.setdefault("status", {"phase": "Pending"})
        return obj

    def _create(
        self, rtype: ResourceType, ns: str | None, data: Any, params: Mapping[str, str]
    ) -> Obj:
        if not isinstance(data, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        obj = copy.deepcopy(data)
        meta = obj.setdefault("metadata", {})
        if (
            obj.get("kind", rtype.kind) != rtype.kind
            or obj.get("apiVersion", rtype.api_version) != rtype.api_version
        ):
            raise ApiError(
                400,
                "BadRequest",
                f"the body is {obj.get('apiVersion')}/{obj.get('kind')}, "
                f"the URL wants {rtype.api_version}/{rtype.kind}",
            )
        if rtype.namespaced:
            if meta.get("namespace") and ns and meta["namespace"] != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace "
                    "sent on the request",
                )
            ns = ns or meta.get("namespace")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
            ns = None
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(
                    422,
                    "Invalid",
                    f'{rtype.kind} "" is invalid: metadata.name: Required value: '
                    "name or generateName is required",
                )
            meta["name"] = meta["generateName"] + "".join(
                random.choices(string.ascii_lowercase + string.digits, k=5)
            )
        self._check_namespace(rtype, ns)
        if self.get_object(rtype, ns, meta["name"]) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{self._kind_ref(rtype)} "{meta["name"]}" already exists',
                {"name": meta["name"], "group": rtype.group, "kind": rtype.plural},
            )
        for key in (
            "resourceVersion",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "generation",
            "managedFields",
        ):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_rfc3339(), generation=1)
        if "status" in rtype.subresources:
            obj.pop("status", None)
        obj = self._validate_custom(rtype, obj, None, params)
        obj = self._default_builtin(rtype, obj, None)
        if rtype.kind == "CustomResourceDefinition":
            self._register_crd(obj)
        if params.get("dryRun"):
            return self._with_kind(rtype, obj)
        self._store(rtype, ns, meta["name"], obj, "ADDED")
        self.created_at[(rtype.plural, ns or "", meta["name"])] = time.monotonic()
        return self._with_kind(rtype, self.get_object(rtype, ns, meta["name"]))

    def _write(
        self, rtype: ResourceType, route: Route, old: Obj, new: Obj, params: Mapping[str, str]
    ) -> Obj:
        """Finish an update or patch of ``old`` into ``new`` (both full objects)."""
        ns, name, sub = (route.namespace if rtype.namespaced else None), route.name, route.sub
        assert name is not None
        if not isinstance(new, dict):
            raise ApiError(400, "BadRequest", "the object must be a JSON object")
        new_meta = new.setdefault("metadata", {})
        rv = new_meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {self._kind_ref(rtype)} "{name}": the object '
                "has been modified; please apply your changes to the latest version and try again",
                {"name": name, "kind": rtype.plural},
            )
        if new_meta.get("name", name) != name:
            raise ApiError(
                400, "BadRequest", "the name of the object does not match the name in the URL"
            )
        if sub == "status":
            merged = copy.deepcopy(old)
            merged["status"] = new.get("status")
            if merged["status"] is None:
                merged.pop("status")
            new = merged
        elif "status" in rtype.subresources:
            new = (
                {**new, "status": old.get("status")}
                if "status" in old
                else {k: v for k, v in new.items() if k != "status"}
            )
        meta = new["metadata"]
        for key in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "namespace",
        ):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
            else:
                meta.pop(key, None)
        meta["name"] = name
        meta["generation"] = old["metadata"].get("generation", 1)
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        new = {
            "apiVersion": rtype.api_version,
            "kind": rtype.kind,
            **{k: v for k, v in new.items() if k not in ("apiVersion", "kind")},
        }
        new = self._validate_custom(rtype, new, old, params)
        new = self._default_builtin(rtype, new, old)
        if _content(new) != _content(old):
            meta = new["metadata"]
            meta["generation"] = meta.get("generation", 1) + 1
        if new == self._with_kind(rtype, old):
            return new  # a no-op write: no new resourceVersion, no watch event
        if rtype.kind == "CustomResourceDefinition":
            self._register_crd(new)
        if params.get("dryRun"):
            return new
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._store(rtype, ns, name, None, "DELETED", old=new)
            self._collect_garbage()
            return new
        self._store(rtype, ns, name, new, "MODIFIED", old=old)
        return self._with_kind(rtype, self.get_object(rtype, ns, name))

    def _update(
        self, rtype: ResourceType, route: Route, data: Any, params: Mapping[str, str]
    ) -> Obj:
        assert route.name is not None
        old = self._must_get(rtype, route.namespace, route.name)
        if route.sub == "scale":
            return self._write_scale(rtype, route, old, data, params)
        return self._write(rtype, route, old, copy.deepcopy(data), params)

    def _patch(
        self, rtype: ResourceType, route: Route, ctype: str, data: Any, params: Mapping[str, str]
    ) -> Obj:
        assert route.name is not None
        old = self._must_get(rtype, route.namespace, route.name)
        if route.sub == "scale":
            try:
                scale = patches.apply_patch(ctype, self._scale_view(rtype, old), data)
            except patches.PatchError as e:
                raise ApiError(e.code, e.reason, str(e)) from e
            return self._write_scale(rtype, route, old, scale, params)
        try:
            new = patches.apply_patch(ctype, old, data)
        except patches.PatchError as e:
            raise ApiError(e.code, e.reason, str(e)) from e
        return self._write(rtype, route, old, new, params)

    def _write_scale(
        self, rtype: ResourceType, route: Route, old: Obj, scale: Any, params: Mapping[str, str]
    ) -> Obj:
        assert rtype.scale is not None
        replicas = (scale or {}).get("spec", {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(
                422,
                "Invalid",
                f'Scale.autoscaling "{route.name}" is invalid: spec.replicas: '
                f"Invalid value: {replicas!r}: must be greater than or equal to 0",
            )
        new = copy.deepcopy(old)
        _set_path(new, rtype.scale["specReplicasPath"], replicas)
        new["metadata"].pop("resourceVersion", None)
        written = self._write(rtype, Route(rtype, route.namespace, route.name), old, new, params)
        return self._scale_view(rtype, written)

    def _delete(
        self,
        rtype: ResourceType,
        ns: str | None,
        name: str,
        body: Mapping[str, Any],
        params: Mapping[str, str],
        gc: bool = True,
    ) -> Obj:
        old = self._must_get(rtype, ns, name)
        if params.get("dryRun"):
            return old
        policy = body.get("propagationPolicy") or params.get("propagationPolicy") or "Background"
        ns = ns if rtype.namespaced else None
        if old["metadata"].get("finalizers"):
            if not old["metadata"].get("deletionTimestamp"):
                new = copy.deepcopy(old)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                new["metadata"]["generation"] = new["metadata"].get("generation", 1) + 1
                self._store(rtype, ns, name, new, "MODIFIED", old=old)
            return self._with_kind(rtype, self.get_object(rtype, ns, name))
        self._store(rtype, ns, name, None, "DELETED", old=old)
        if policy == "Orphan":
            self._orphan(old["metadata"]["uid"])
        if rtype.kind == "Namespace":
            for child_type, obj in list(self._iter(ns=name)):
                if child_type is not None:
                    self._store(child_type, name, obj["metadata"]["name"], None, "DELETED", old=obj)
        if rtype.kind == "CustomResourceDefinition":
            self._unregister_crd(old)
        if gc:
            self._collect_garbage()
        return old

    def _delete_collection(
        self, rtype: ResourceType, ns: str | None, params: Mapping[str, str]
    ) -> Obj:
        listing = self._list(rtype, ns, params)
        for obj in listing["items"]:
            meta = obj["metadata"]
            self._delete(rtype, meta.get("namespace"), meta["name"], {}, {})
        return listing

    # --- garbage collection -------------------------------------------------------------------

    def _orphan(self, owner_uid: str) -> None:
        for rtype, obj in list(self._iter()):
            refs = obj["metadata"].get("ownerReferences") or []
            if rtype is not None and any(r.get("uid") == owner_uid for r in refs):
                new = copy.deepcopy(obj)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != owner_uid]
                self._store(
                    rtype,
                    obj["metadata"].get("namespace"),
                    obj["metadata"]["name"],
                    new,
                    "MODIFIED",
                    old=obj,
                )

    def _collect_garbage(self) -> None:
        """Delete every object whose owners are all gone (background cascading deletion)."""
        while True:
            alive = {obj["metadata"].get("uid") for _, obj in self._iter()}
            victims = [
                (rtype, obj)
                for rtype, obj in self._iter()
                if rtype is not None
                and obj["metadata"].get("ownerReferences")
                and not any(r.get("uid") in alive for r in obj["metadata"]["ownerReferences"])
                and not obj["metadata"].get("deletionTimestamp")
            ]
            if not victims:
                return
            for rtype, obj in victims:
                meta = obj["metadata"]
                if self.get_object(rtype, meta.get("namespace"), meta["name"]) is not None:
                    self._delete(rtype, meta.get("namespace"), meta["name"], {}, {}, gc=False)

    # --- custom resource definitions ----------------------------------------------------------

    def _register_crd(self, crd: Obj) -> None:
        try:
            new_types = crd_types(crd)
        except (KeyError, ValueError, RuleCompileError) as e:
            raise ApiError(
                422,
                "Invalid",
                f'CustomResourceDefinition.apiextensions.k8s.io "{crd["metadata"]["name"]}" '
                f"is invalid: {e}",
            ) from e
        names = crd["spec"]["names"]
        crd["status"] = {
            "acceptedNames": {
                k: names[k]
                for k in ("kind", "listKind", "plural", "singular", "shortNames", "categories")
                if k in names
            },
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": now_rfc3339(),
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": now_rfc3339(),
                },
            ],
        }
        for rtype in new_types:
            self.types[rtype.key] = rtype

    def _unregister_crd(self, crd: Obj) -> None:
        for key, rtype in list(self.types.items()):
            if rtype.crd_name == crd["metadata"]["name"]:
                for _, obj in list(self._iter(rtype)):
                    self._store(
                        rtype,
                        obj["metadata"].get("namespace"),
                        obj["metadata"]["name"],
                        None,
                        "DELETED",
                        old=obj,
                    )
                del self.types[key]

    # --- helpers for tests (the "controllers" this emulator does not run) ---------------------

    def rtype(self, api_version: str, plural: str) -> ResourceType:
        group, _, version = api_version.rpartition("/")
        return self.types[(group, version, plural)]

    def apply_yaml(self, text: str) -> list[Obj]:
        """Create every document of a YAML stream (like ``kubectl create -f``), synchronously."""
        out = []
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            rtype = next(
                t
                for t in self.types.values()
                if t.kind == doc["kind"] and t.api_version == doc["apiVersion"]
            )
            out.append(self._create(rtype, doc.get("metadata", {}).get("namespace"), doc, {}))
        return out

    def set_tokens(self, tokens: list[str] | None) -> None:
        """Accept only these bearer tokens from now on (None: accept any request)."""
        self.tokens = None if tokens is None else set(tokens)

    def set_status(
        self, api_version: str, plural: str, ns: str | None, name: str, status: Obj
    ) -> Obj:
        """Merge ``status`` into an object's status, as its controller would."""
        rtype = self.rtype(api_version, plural)
        old = self._must_get(rtype, ns, name)
        new = copy.deepcopy(old)
        new["status"] = patches.merge_patch(old.get("status") or {}, status)
        new["metadata"].pop("resourceVersion", None)
        return self._write(rtype, Route(rtype, ns, name, "status"), old, new, {})

    def create(self, api_version: str, plural: str, ns: str | None, obj: Obj) -> Obj:
        return self._create(self.rtype(api_version, plural), ns, obj, {})

    def delete(self, api_version: str, plural: str, ns: str | None, name: str) -> Obj:
        return self._delete(self.rtype(api_version, plural), ns, name, {}, {})

    def get(self, api_version: str, plural: str, ns: str | None, name: str) -> Obj | None:
        return self.get_object(self.rtype(api_version, plural), ns, name)

    def list(self, api_version: str, plural: str, ns: str | None = None) -> list[Obj]:
        return [obj for _, obj in self._iter(self.rtype(api_version, plural), ns)]

    def writes(self, *plurals: str) -> list[rendering.Request]:
        """Requests that changed (or tried to change) objects of these resources."""
        return [
            r
            for r in self._requests
            if r.method.value in ("POST", "PUT", "PATCH", "DELETE")
            and r.resource is not None
            and (not plurals or r.resource.plural in plurals)
        ]
