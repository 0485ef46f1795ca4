"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Handlers turn request validation errors (bad fields, malformed JSON), ValueErrors from
the engine's validation and ``APIError``s into that shape; bad input is always a 4xx.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class SafeJSONResponse(JSONResponse):
    """JSON that never fails to encode: lone surrogates (valid in JSON strings a client
    sent) are escaped instead of breaking UTF-8 encoding."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


# Line breaks for str.splitlines (and so for SSE readers built on it, such as httpx's
# iter_lines) that JSON leaves raw: escaped, so an event never spans two "lines".
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj: Any) -> str:
    """Compact JSON on one line; ASCII-escaped only when the text holds unencodable
    surrogates."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.translate(_LINE_BREAKS)


class APIError(Exception):
    """An error answered with ``status`` in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return SafeJSONResponse(error_body(status, message, param, code), status, headers=headers)


def unauthorized_response() -> Any:
    """401 for a missing or wrong API key (the server's and the router's)."""
    return error_response(
        401,
        "missing or incorrect API key: send 'Authorization: Bearer <key>'",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def sse_error(message: str, status: int = 500, code: str | None = None) -> str:
    """An error event for a stream that already started (then ``data: [DONE]``)."""
    return f"data: {dumps(error_body(status, message, None, code))}\n\n"


def param_of(err: ValueError, rename: dict[str, str] | None = None) -> str | None:
    """The request field an engine error names (``InvalidRequestError.param``), renamed
    to the API's name for it where ``rename`` says so."""
    name = getattr(err, "param", None)
    if name is None:
        return None
    return (rename or {}).get(name, name)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _validation_message(
    errors: Sequence[Any], content_type: str | None = None
) -> tuple[str, str | None]:
    """One line naming the first invalid field (and how many more), and that field: for
    FastAPI's errors of a request body, or pydantic's of a request model built inside a
    handler. ``content_type``: the request's header ("" when absent; None: not known)."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', first.get('msg'))}", None
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    if param is None and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        if content_type is not None and not _is_json(content_type):
            got = repr(content_type) if content_type else "none"
            return (
                f"the request body must be JSON sent as Content-Type: application/json, "
                f"got Content-Type {got}",
                None,
            )
        return "the request body must be a JSON object", None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors(), request.headers.get("content-type", ""))
        return error_response(400, message, param)

    @app.exception_handler(ValidationError)
    async def _model(request: Request, exc: ValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())  # a model a handler built
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(ValueError)
    async def _value(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), param_of(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return error_response(
            exc.status_code, str(exc.detail), None, code, getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")
