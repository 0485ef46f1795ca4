"""The subset of kubectl JSONPath that printer columns use: ``.a.b``, ``[0]``, ``[?(@.k=="v")]``."""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(
    r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.\-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]"
)


def evaluate(path: str, obj: Any) -> list[Any]:
    """All values ``path`` selects in ``obj`` (empty when none)."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    if path.startswith("$"):
        path = path[1:]
    values = [obj]
    pos = 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[pos:]!r}")
        pos = m.end()
        field, index, fkey, fval = m.groups()
        out = []
        for v in values:
            if field is not None and isinstance(v, dict) and field in v:
                out.append(v[field])
            elif index is not None and isinstance(v, list) and int(index) < len(v):
                out.append(v[int(index)])
            elif fkey is not None and isinstance(v, list):
                for item in v:
                    if _get(item, fkey) == fval:
                        out.append(item)
        values = out
    return values


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj
