"""A request's output constraint: OpenAI's ``response_format``, vLLM's ``guided_*`` fields
and ``structured_outputs``, reduced to one ``StructuredOutputsParams`` and checked (off
the event loop) so that a grammar that cannot be built is a 400 naming the problem."""

from __future__ import annotations

import asyncio
from typing import Any

from kvscale.server.api.errors import APIError
from kvscale.server.api.protocol import SamplingRequest
from kvscale.server.errors import InvalidRequestError
from kvscale.server.structured.params import StructuredOutputsParams, check


def _from_response_format(req: SamplingRequest) -> StructuredOutputsParams | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if rf.type == "json_schema":
        js = rf.json_schema
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError(
                400,
                "response_format json_schema needs json_schema.schema (the JSON schema)",
                param="response_format.json_schema",
            )
        return StructuredOutputsParams(json=js["schema"], param="response_format.json_schema")
    raise APIError(
        400,
        f"response_format type {rf.type!r} is not supported; use text, json_object or json_schema",
        param="response_format.type",
    )


def requested(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint (None: free text); 400 for a malformed one or for more
    than one at a time."""
    found: list[tuple[str, Any]] = []
    try:
        if (rf := _from_response_format(req)) is not None:
            found.append(("response_format", rf))
        guided = {
            "guided_json": dict(json=req.guided_json),
            "guided_regex": dict(regex=req.guided_regex),
            "guided_choice": dict(choice=req.guided_choice),
            "guided_grammar": dict(grammar=req.guided_grammar),
        }
        for name, kw in guided.items():
            if next(iter(kw.values())) is not None:
                found.append((name, StructuredOutputsParams(**kw, param=name)))
        so = req.structured_outputs
        if so is not None:
            fields = so.model_dump(by_alias=True, exclude_none=True)
            found.append(
                (
                    "structured_outputs",
                    StructuredOutputsParams(**fields, param="structured_outputs"),
                )
            )
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from e
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise APIError(
            400, f"only one output constraint may be given; got {names}", param=found[1][0]
        )
    return found[0][1] if found else None


async def checked(params: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
    """``params`` once its grammar builds (parsed in a thread, cached by spec); 400
    naming the problem otherwise."""
    if params is None:
        return None
    try:
        await asyncio.to_thread(_check_cached, params.kind, params.spec, params.param)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from e
    return params


_CHECKED: dict[tuple[str, str], str | None] = {}  # key -> None (ok) or the error message
_MAX_CHECKED = 1024


def _check_cached(kind: str, spec: str, param: str) -> None:
    key = (kind, spec)
    if key not in _CHECKED:
        try:
            check(StructuredOutputsParams(**_field(kind, spec), param=param))
            _CHECKED[key] = None
        except InvalidRequestError as e:
            _CHECKED[key] = str(e).split(": ", 1)[1] if ": " in str(e) else str(e)
        if len(_CHECKED) > _MAX_CHECKED:
            _CHECKED.pop(next(iter(_CHECKED)))
    error = _CHECKED[key]
    if error is not None:
        raise InvalidRequestError(f"{param}: {error}", param=param, code="invalid_grammar")


def _field(kind: str, spec: str) -> dict[str, Any]:
    import json

    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"choice": json.loads(spec)}
    return {kind: spec}
