"""What the API server does with a CRD's structural schema on every write of a custom
resource: prune unknown fields (or refuse them with ``fieldValidation=Strict``), apply
defaults, validate with the OpenAPI schema (via ``jsonschema``; ``pattern`` in RE2, the Go
regexp dialect the API server uses, where ``$`` never matches before a final newline and
``\\w``/``\\s`` are ASCII) and with the CEL rules in
``x-kubernetes-validations`` (via ``cel-python``), reporting causes the way Kubernetes does
(``spec.engine.tensorParallelSize: Invalid value: "integer": <message>``).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema
import jsonschema.validators
import re2

ROOT_KEEP = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True)
class Cause:
    """One reason a write is refused (``details.causes[]`` of the Status)."""

    field: str
    message: str
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class RuleCompileError(ValueError):
    """A CEL rule in a CRD does not compile (the CRD is refused)."""


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    env = celpy.Environment()
    try:
        ast = env.compile(rule)
    except Exception as e:
        raise RuleCompileError(
            f"x-kubernetes-validations rule {rule!r} does not compile: {e}"
        ) from e
    return env.program(ast)


def compile_rules(schema: Mapping[str, Any]) -> None:
    """Compile every rule of a schema; raise :class:`RuleCompileError` on the first bad one."""
    for node in _walk_schema(schema):
        for rule in node.get("x-kubernetes-validations") or ():
            _program(rule["rule"])


def _walk_schema(schema: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield schema
    for sub in (schema.get("properties") or {}).values():
        yield from _walk_schema(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), Mapping):
            yield from _walk_schema(schema[key])


def _fmt(path: list[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _re2_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if isinstance(instance, str) and re2.search(pattern, instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


# Draft 7 as the API server applies it: ``pattern`` is a Go (RE2) regular expression.
ApiServerValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator, {"pattern": _re2_pattern}
)


class StructuralSchema:
    """One version's ``openAPIV3Schema``."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.schema = copy.deepcopy(dict(schema))
        compile_rules(self.schema)
        self._validator = ApiServerValidator(_to_json_schema(self.schema))

    # --- pruning ----------------------------------------------------------------------------

    def prune(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Drop fields the schema does not know; return the pruned object and their paths."""
        unknown: list[str] = []
        pruned = self._prune(self.schema, copy.deepcopy(obj), [], unknown, root=True)
        return pruned, unknown

    def _prune(self, schema: Mapping[str, Any], value: Any, path: list, unknown: list, root=False):
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            extra = schema.get("additionalProperties")
            keep_all = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
                "x-kubernetes-embedded-resource"
            )
            for key in list(value):
                if root and key in ROOT_KEEP:
                    continue  # apiVersion, kind and metadata are the server's, never pruned
                if key in props:
                    value[key] = self._prune(props[key], value[key], [*path, key], unknown)
                elif isinstance(extra, Mapping):
                    value[key] = self._prune(extra, value[key], [*path, key], unknown)
                elif not keep_all and extra is not True:
                    unknown.append(_fmt([*path, key]))
                    del value[key]
        elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
            return [
                self._prune(schema["items"], v, [*path, i], unknown) for i, v in enumerate(value)
            ]
        return value

    # --- defaulting -------------------------------------------------------------------------

    def default(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Apply ``default`` values, recursing into defaulted objects as Kubernetes does."""
        out = copy.deepcopy(obj)
        self._default(self.schema, out)
        return out

    def _default(self, schema: Mapping[str, Any], value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value:
                    self._default(sub, value[key])
            extra = schema.get("additionalProperties")
            if isinstance(extra, Mapping):
                for key in value:
                    if key not in (schema.get("properties") or {}):
                        self._default(extra, value[key])
        elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
            for item in value:
                self._default(schema["items"], item)

    # --- validation -------------------------------------------------------------------------

    def validate(self, obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[Cause]:
        causes = [self._cause(err) for err in self._validator.iter_errors(obj)]
        if not causes:  # like the API server: CEL runs on schema-valid objects
            causes += self._cel(self.schema, obj, old, [])
        return causes

    def _cause(self, err: jsonschema.ValidationError) -> Cause:
        path = list(err.absolute_path)
        field = _fmt(path)
        v = err.validator
        if v == "required":
            missing = err.message.split("'")[1]
            return Cause(_fmt([*path, missing]), "Required value", "FieldValueRequired")
        if v == "enum":
            allowed = ", ".join(json.dumps(a) for a in err.validator_value)
            return Cause(
                field,
                f"Unsupported value: {json.dumps(err.instance)}: supported values: {allowed}",
                "FieldValueNotSupported",
            )
        if v in ("type", "anyOf"):
            return Cause(
                field,
                f'Invalid value: "{_type_name(err.instance)}": {field} in body must be of '
                f"type {err.validator_value if v == 'type' else 'integer or string'}",
                "FieldValueTypeInvalid",
            )
        words = {
            "minimum": "should be greater than or equal to",
            "maximum": "should be less than or equal to",
            "minLength": "should be at least {} chars long",
            "maxLength": "may not be more than {} bytes",
            "maxItems": "must have at most {} items",
            "minItems": "should have at least {} items",
            "pattern": "should match '{}'",
        }
        if v in words:
            text = words[v]
            text = (
                text.format(err.validator_value)
                if "{}" in text
                else f"{text} {err.validator_value}"
            )
            return Cause(
                field, f"Invalid value: {json.dumps(err.instance)}: {field} in body {text}"
            )
        return Cause(field, f"Invalid value: {json.dumps(err.instance)}: {err.message}")

    def _cel(self, schema: Mapping[str, Any], value: Any, old: Any, path: list) -> list[Cause]:
        causes: list[Cause] = []
        for rule in schema.get("x-kubernetes-validations") or ():
            text = rule["rule"]
            uses_old = "oldSelf" in text
            if uses_old and old is None:
                continue  # transition rules only run on updates
            activation = {"self": celpy.json_to_cel(value)}
            if uses_old:
                activation["oldSelf"] = celpy.json_to_cel(old)
            try:
                ok = _program(text).evaluate(activation)
                failed = not bool(ok) or isinstance(ok, celpy.CELEvalError)
            except Exception:
                failed = True
            if failed:
                where = _fmt(path) + (rule.get("fieldPath") or "")
                message = rule.get("message") or f"failed rule: {text}"
                causes.append(
                    Cause(where.lstrip("."), f'Invalid value: "{_type_name(value)}": {message}')
                )
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            extra = schema.get("additionalProperties")
            for key, sub_value in value.items():
                sub = props.get(key) or (extra if isinstance(extra, Mapping) else None)
                if sub is not None:
                    sub_old = old.get(key) if isinstance(old, Mapping) else None
                    causes += self._cel(sub, sub_value, sub_old, [*path, key])
        elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
            for i, item in enumerate(value):
                causes += self._cel(schema["items"], item, None, [*path, i])
        return causes


def _to_json_schema(schema: Any) -> Any:
    """OpenAPI v3 (Kubernetes flavour) -> JSON Schema draft 7."""
    if isinstance(schema, list):
        return [_to_json_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key in ("default", "description", "example"):
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {k: _to_json_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = _to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_to_json_schema(v) for v in value]
        elif key == "nullable":
            continue
        else:
            out[key] = value
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
    if out.get("type") == "object" and "metadata" in (out.get("properties") or {}):
        out["properties"]["metadata"] = {"type": "object"}
    return out
