"""Errors for bad input, typed so that callers never parse messages."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine will not run. ``param``: the request field at fault
    ("prompt", "max_tokens", a sampling setting); ``code``: a machine-readable reason
    (e.g. ``context_length_exceeded``) or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
