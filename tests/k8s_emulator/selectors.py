"""Label and field selectors, as the API server parses them (``?labelSelector=``...)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Matcher = Callable[[Mapping[str, Any]], bool]

_SET_RE = re.compile(r"^\s*([^\s!=,()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


class SelectorError(ValueError):
    """An unparsable selector (HTTP 400 BadRequest)."""


def _split(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _requirement(term: str) -> Callable[[Mapping[str, str]], bool]:
    m = _SET_RE.match(term)
    if m:
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    for op in ("!=", "==", "="):
        if op in term:
            key, value = (s.strip() for s in term.split(op, 1))
            if not key:
                raise SelectorError(f"invalid selector term {term!r}")
            if op == "!=":
                return lambda labels: labels.get(key) != value
            return lambda labels: labels.get(key) == value
    if term.startswith("!"):
        key = term[1:].strip()
        return lambda labels: key not in labels
    if re.match(r"^[\w./-]+$", term):
        return lambda labels: term in labels
    raise SelectorError(f"invalid selector term {term!r}")


def label_matcher(selector: str | None) -> Matcher:
    """``app=x,tier in (a,b),!legacy`` -> predicate over an object."""
    if not selector:
        return lambda obj: True
    reqs = [_requirement(t) for t in _split(selector)]

    def match(obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(req(labels) for req in reqs)

    return match


def _field(obj: Mapping[str, Any], path: str) -> str | None:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return None if cur is None else str(cur)


def field_matcher(selector: str | None) -> Matcher:
    """``metadata.name=x,status.phase!=Running`` -> predicate (any dotted field path)."""
    if not selector:
        return lambda obj: True
    reqs = []
    for term in _split(selector):
        for op in ("!=", "==", "="):
            if op in term:
                path, value = (s.strip() for s in term.split(op, 1))
                reqs.append((path, op == "!=", value))
                break
        else:
            raise SelectorError(f"invalid field selector term {term!r}")

    def match(obj: Mapping[str, Any]) -> bool:
        for path, negate, value in reqs:
            actual = _field(obj, path) or ""
            if (actual == value) == negate:
                return False
        return True

    return match


def selector_from_label_selector(sel: Mapping[str, Any] | None) -> str:
    """A LabelSelector object (matchLabels/matchExpressions) as a selector string."""
    if not sel:
        return ""
    terms = [f"{k}={v}" for k, v in (sel.get("matchLabels") or {}).items()]
    for expr in sel.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In":
            terms.append(f"{key} in ({','.join(values)})")
        elif op == "NotIn":
            terms.append(f"{key} notin ({','.join(values)})")
        elif op == "Exists":
            terms.append(key)
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    return ",".join(terms)
