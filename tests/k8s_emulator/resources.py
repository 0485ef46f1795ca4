"""The API's resource types: the built-in ones (from kmock's bundled discovery data of a
K3s cluster) and those that CustomResourceDefinitions add while the server runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kmock

from tests.k8s_emulator.schema import StructuralSchema

# Built-in kinds that have a scale subresource, with where their replicas live.
BUILTIN_SCALE = {
    ("apps", "deployments"),
    ("apps", "replicasets"),
    ("apps", "statefulsets"),
}


@dataclass
class ResourceType:
    """One served resource (group/version/plural) and what the server knows about it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    verbs: list[str] = field(default_factory=list)
    subresources: set[str] = field(default_factory=set)
    schema: StructuralSchema | None = None  # custom resources only
    printer_columns: list[dict[str, Any]] = field(default_factory=list)
    scale: dict[str, str] | None = None  # specReplicasPath, statusReplicasPath, labelSelectorPath
    crd_name: str | None = None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    @property
    def kmock_resource(self) -> kmock.resource:
        return kmock.resource(self.group, self.version, self.plural)


def builtin_types() -> dict[tuple[str, str, str], ResourceType]:
    array = kmock.ResourcesArray()
    array.load_bundled()
    out = {}
    for res in array:
        info = array[res]
        rtype = ResourceType(
            group=res.group or "",
            version=res.version or "v1",
            plural=res.plural or "",
            kind=info.kind or res.plural.capitalize(),
            namespaced=bool(info.namespaced),
            singular=info.singular or "",
            short_names=sorted(info.shortnames),
            categories=sorted(info.categories),
            verbs=sorted(info.verbs),
            subresources=set(info.subresources),
        )
        if (rtype.group, rtype.plural) in BUILTIN_SCALE:
            rtype.scale = {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": "",
            }
        out[rtype.key] = rtype
    return out


def crd_types(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The resource types a CRD serves (raises ValueError / RuleCompileError if invalid)."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        sub = version.get("subresources") or {}
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if not schema:
            raise ValueError(
                f"spec.versions[{version['name']}].schema.openAPIV3Schema: Required value"
            )
        out.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                singular=names.get("singular", names["kind"].lower()),
                short_names=list(names.get("shortNames") or []),
                categories=list(names.get("categories") or []),
                verbs=[
                    "create",
                    "delete",
                    "deletecollection",
                    "get",
                    "list",
                    "patch",
                    "update",
                    "watch",
                ],
                subresources={k for k in ("status", "scale") if k in sub},
                schema=StructuralSchema(schema),
                printer_columns=list(version.get("additionalPrinterColumns") or []),
                scale=dict(sub["scale"]) if "scale" in sub else None,
                crd_name=crd["metadata"]["name"],
            )
        )
    return out
