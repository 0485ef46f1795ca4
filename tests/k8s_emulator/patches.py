"""The API server's patch types: JSON merge, JSON patch and (approximate) strategic merge."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonpatch

MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


class PatchError(ValueError):
    """The patch cannot apply: 422 Invalid, or 415/400 for a type or body the server refuses."""

    def __init__(self, message: str, code: int = 422, reason: str = "Invalid") -> None:
        super().__init__(message)
        self.code, self.reason = code, reason


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, everything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _merge_key(items: list[Any]) -> str | None:
    for key in ("name", "type", "containerPort", "mountPath", "devicePath", "port", "ip"):
        if items and all(isinstance(i, Mapping) and key in i for i in items):
            return key
    return None


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge for the common cases: lists of objects merge by their usual key
    (``name``, ``type``, ...); ``$patch: replace|delete`` and ordering directives are honoured
    or ignored the way kubectl's client-side apply needs."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # $setElementOrder/..., $retainKeys, ...: ordering hints
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_lists(result[key], value)
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _merge_lists(old: list[Any], new: list[Any]) -> list[Any]:
    key = _merge_key([*old, *new])
    if key is None:
        return [x for x in copy.deepcopy(new) if not (isinstance(x, Mapping) and "$patch" in x)]
    merged = {item[key]: item for item in old}
    order = [item[key] for item in old]
    for item in new:
        if item.get("$patch") == "delete":
            merged.pop(item[key], None)
            continue
        if item[key] in merged:
            merged[item[key]] = strategic_merge_patch(merged[item[key]], item)
        else:
            merged[item[key]] = copy.deepcopy(dict(item))
            order.append(item[key])
    return [merged[k] for k in order if k in merged]


def apply_patch(content_type: str, target: Mapping[str, Any], patch: Any) -> dict[str, Any]:
    ctype = content_type.split(";", 1)[0].strip()
    if ctype == MERGE:
        if not isinstance(patch, Mapping):
            raise PatchError("a merge patch must be a JSON object", 400, "BadRequest")
        return merge_patch(target, patch)
    if ctype == STRATEGIC:
        if not isinstance(patch, Mapping):
            raise PatchError("a strategic merge patch must be a JSON object", 400, "BadRequest")
        return strategic_merge_patch(target, patch)
    if ctype == JSON:
        if not isinstance(patch, list):
            raise PatchError("a JSON patch must be a list of operations", 400, "BadRequest")
        try:
            return jsonpatch.apply_patch(copy.deepcopy(dict(target)), patch)
        except jsonpatch.JsonPatchTestFailed as e:
            raise PatchError(f"the JSON patch test failed: {e}") from e
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
            raise PatchError(f"the JSON patch cannot apply: {e}") from e
    raise PatchError(f"unsupported patch type {ctype!r}", 415, "UnsupportedMediaType")
