"""What a request constrains its output to, in one normalized form.

``StructuredOutputsParams`` takes vLLM's fields (exactly one of ``json``, ``regex``,
``choice``, ``grammar``, ``json_object``) and reduces them to a ``(kind, spec)`` key:
``kind`` one of ``KINDS`` and ``spec`` a string (a JSON schema serialized in its own
key order, a regex, an EBNF/Lark grammar, or a JSON list of choices). Equal keys compile to
the same grammar, so the key is what compiled grammars are cached under. ``check``
parses the spec with xgrammar (no tokenizer needed, milliseconds) so that a grammar that
cannot be built is a 400 naming the problem before anything is queued.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a grammar spec larger than this (1 MiB) is refused


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``structured_outputs``).

    ``json``: a JSON schema (dict or JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: the output is
    one of these strings; ``grammar``: an EBNF (GBNF) or Lark grammar. ``param`` names
    the request field it came from, for error messages.
    """

    json: dict[str, Any] | str | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    param: str = "structured_outputs"
    kind: str = field(init=False)
    spec: str = field(init=False)

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.param} must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {given or 'none'}",
                param=self.param,
            )
        kind = given[0]
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "spec", _normalize(kind, getattr(self, kind), self.param))

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached under."""
        return self.kind, self.spec


def _normalize(kind: str, value: Any, param: str) -> str:
    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(f"{param}: {msg}", param=param)

    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad(f"the JSON schema is not valid JSON: {e}") from e
        if value is True:
            value = {}
        if not isinstance(value, dict):
            raise bad(f"a JSON schema must be an object, got {type(value).__name__}")
        spec = json.dumps(value, ensure_ascii=False)  # key order kept: it orders the output
    elif kind == "json_object":
        if value is not True:
            raise bad("json_object must be true")
        spec = ""
    elif kind == "choice":
        if not isinstance(value, list) or not value:
            raise bad("choice must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in value):
            raise bad("every choice must be a non-empty string")
        spec = json.dumps(value, ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            raise bad(f"{kind} must be a non-empty string")
        if "\x00" in value:
            raise bad(f"{kind} must not contain a NUL character")
        spec = value
    if len(spec) > MAX_SPEC_CHARS:
        raise bad(f"the {kind} specification has {len(spec)} characters; at most {MAX_SPEC_CHARS}")
    return spec


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (as JSON string literals,
    which EBNF string literals accept)."""
    alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alts}\n"


def is_lark(grammar: str) -> bool:
    """True when a grammar looks like Lark rather than EBNF/GBNF (no ``::=`` on any
    rule line; Lark writes ``rule: ...``)."""
    lines = [ln.split("//")[0].split("#")[0].strip() for ln in grammar.splitlines()]
    return not any("::=" in ln for ln in lines if ln)


def check(params: StructuredOutputsParams) -> None:
    """Builds the spec's grammar (not its token masks) with xgrammar; InvalidRequestError
    naming the problem if it cannot. Safe to call from any thread."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise InvalidRequestError(
            "structured outputs need the xgrammar package, which this server lacks "
            "(pip install xgrammar)",
            param=params.param,
            code="unsupported",
        ) from e

    kind, spec = params.key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
        elif kind == "grammar":
            if is_lark(spec):
                xgr.Grammar.from_lark(spec)
            else:
                xgr.Grammar.from_ebnf(spec)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with the reason
        raise InvalidRequestError(
            f"{params.param}: cannot build a grammar from this {kind}: {_reason(e)}",
            param=params.param,
            code="invalid_grammar",
        ) from e


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    msg = str(e).strip()
    if msg.startswith("[") and "] " in msg:
        msg = msg.split("] ", 1)[1]
    if ".cc:" in msg.split(": ", 1)[0]:
        msg = msg.split(": ", 1)[1] if ": " in msg else msg
    return msg.strip() or type(e).__name__
