"""Tool calls in model output: one parser per format of the model families kvscale loads.

- ``hermes`` (Qwen2.5, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  repeated; text before the first tag is content.
- ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole output is
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several
  separated by ``;``; any other output is content.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+); text before it is content.
- ``json_array``: ``[{"name": ..., "parameters": {...}}, ...]``, what the grammar of
  ``tool_choice: required`` produces.

Every parser reads text that may still be growing (a stream): it returns the content so
far (holding back a tail that may be the start of a tool-call marker) and each call's
name (once complete) and raw argument text so far. The arguments are the exact JSON
text the model wrote (not re-serialized), so a stream's argument deltas add up to the
non-streamed arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral")
_WS = " \t\r\n"


@dataclass
class ParsedCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # raw JSON text so far ("" if not started)
    complete: bool  # the call's text is complete


@dataclass
class Parsed:
    content: str | None  # text outside tool calls (None: none at all)
    calls: list[ParsedCall] = field(default_factory=list)


# ---- a tolerant scanner for JSON that may be cut short --------------------------------------
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at ``text[i] == '"'``; None if cut."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``i``; None if the text ends first."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _scan_string(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: up to a delimiter
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


@dataclass
class _Obj:
    name: str | None = None
    arguments: str = ""
    end: int | None = None  # end of the object (exclusive) once closed
    malformed: bool = False


def _scan_call_object(text: str, i: int, arg_keys: tuple[str, ...]) -> _Obj:
    """Reads ``{"name": ..., "<arg key>": {...}, ...}`` starting at ``text[i] == '{'``,
    as far as the text goes."""
    out = _Obj()
    j = i + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text):
            return out
        if text[j] == "}":
            out.end = j + 1
            return out
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            out.malformed = True
            return out
        kend = _scan_string(text, j)
        if kend is None:
            return out
        key = json.loads(text[j:kend])
        j = _skip_ws(text, kend)
        if j >= len(text):
            return out
        if text[j] != ":":
            out.malformed = True
            return out
        j = _skip_ws(text, j + 1)
        vend = scan_value(text, j)
        if key == "name":
            if vend is not None:
                try:
                    name = json.loads(text[j:vend])
                except json.JSONDecodeError:
                    out.malformed = True
                    return out
                out.name = name if isinstance(name, str) else None
        elif key in arg_keys:
            out.arguments = text[j:] if vend is None else text[j:vend]
        if vend is None:
            return out
        j = vend


def _held(content: str, marker: str) -> str:
    """``content`` less a tail that could be the start of ``marker`` (a stream may be
    about to complete it)."""
    for k in range(min(len(marker) - 1, len(content)), 0, -1):
        if content.endswith(marker[:k]):
            return content[:-k]
    return content


def _call(obj: _Obj) -> ParsedCall:
    return ParsedCall(obj.name, obj.arguments, obj.end is not None)


# ---- formats -------------------------------------------------------------------------------
class ToolParser:
    name = ""

    def parse(self, text: str, final: bool = True) -> Parsed:
        """``final`` False: ``text`` may still grow (a tail that may start a marker is
        held back from the content)."""
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.start)
        if first < 0:
            return Parsed(text if final else _held(text, self.start))
        content = text[:first]
        calls: list[ParsedCall] = []
        i = first
        while i >= 0:
            j = _skip_ws(text, i + len(self.start))
            if j >= len(text):
                break
            if text[j] != "{":
                break
            obj = _scan_call_object(text, j, ("arguments", "parameters"))
            if obj.malformed:
                break
            calls.append(_call(obj))
            if obj.end is None:
                break
            i = text.find(self.start, obj.end)
        return Parsed(content or None, calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> Parsed:
        i = _skip_ws(text, 0)
        if text.startswith(self.tag, i):
            i = _skip_ws(text, i + len(self.tag))
        elif i < len(text) and self.tag.startswith(text[i:]) and not final:
            return Parsed(None)  # maybe the tag, still arriving
        if i >= len(text):
            return Parsed(text or None if final else None)
        if text[i] != "{":
            return Parsed(text)
        calls: list[ParsedCall] = []
        while i < len(text) and text[i] == "{":
            obj = _scan_call_object(text, i, ("parameters", "arguments"))
            no_name = obj.name is None and (obj.end is not None or final)
            if obj.malformed or no_name:  # a JSON answer, not a call
                return Parsed(text) if not calls else Parsed(None, calls)
            calls.append(_call(obj))
            if obj.end is None:
                break
            i = _skip_ws(text, obj.end)
            if i < len(text) and text[i] == ";":
                i = _skip_ws(text, i + 1)
        return Parsed(None, calls)


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    args = "[ARGS]"

    def parse(self, text: str, final: bool = True) -> Parsed:
        first = text.find(self.marker)
        if first < 0:
            return Parsed(text if final else _held(text, self.marker))
        content = text[:first] or None
        calls: list[ParsedCall] = []
        i = _skip_ws(text, first + len(self.marker))
        if i < len(text) and text[i] == "[":  # [TOOL_CALLS][{...}, {...}]
            calls = _json_array_calls(text, i, ("arguments", "parameters"))
            return Parsed(content, calls)
        while i < len(text):  # [TOOL_CALLS]name[ARGS]{...}, repeated
            a = text.find(self.args, i)
            if a < 0:
                break
            name = text[i:a].strip()
            j = _skip_ws(text, a + len(self.args))
            end = scan_value(text, j) if j < len(text) else None
            arguments = text[j:] if end is None else text[j:end]
            calls.append(ParsedCall(name, arguments, end is not None))
            if end is None:
                break
            nxt = text.find(self.marker, end)
            if nxt < 0:
                break
            i = _skip_ws(text, nxt + len(self.marker))
        return Parsed(content, calls)


def _json_array_calls(text: str, i: int, arg_keys: tuple[str, ...]) -> list[ParsedCall]:
    calls: list[ParsedCall] = []
    j = i + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text) or text[j] == "]":
            return calls
        if text[j] == ",":
            j += 1
            continue
        if text[j] != "{":
            return calls
        obj = _scan_call_object(text, j, arg_keys)
        if obj.malformed:
            return calls
        calls.append(_call(obj))
        if obj.end is None:
            return calls
        j = obj.end


class JsonArrayParser(ToolParser):
    """The output of the ``tool_choice: required`` grammar."""

    name = "json_array"

    def parse(self, text: str, final: bool = True) -> Parsed:
        i = _skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return Parsed(text if text.strip() else None)
        return Parsed(None, _json_array_calls(text, i, ("parameters", "arguments")))


_BY_NAME: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "json_array": JsonArrayParser,
}


def get_parser(name: str) -> ToolParser:
    """A parser by name (one of PARSERS, or json_array); ValueError naming the choices."""
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(PARSERS)}")
    return cls()


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches the model, or None if not known."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or re.search(r"<\|start_header_id\|>", chat_template):
        return "llama3_json" if "tools" in chat_template else None
    return None
