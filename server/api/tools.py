"""Tool calling for chat completions: ``tools`` and ``tool_choice`` checked, a plan for
rendering and reading the output, and the tool-call deltas of a stream.

- ``none``: the tools are shown to the template, the output is plain content.
- ``auto`` (the default with tools): the model decides; its output is read with the
  server's tool-call parser (``--tool-call-parser``, or the one the chat template's
  format implies). Without one, ``auto`` is a 400 (as in vLLM).
- ``required``: a JSON-schema grammar forces a JSON array of one or more calls
  ``{"name": <one of the tools>, "parameters": <its schema>}`` (at most one when
  ``parallel_tool_calls`` is false).
- a named function: a grammar forces that function's arguments (its parameters
  schema); the message carries that one call and finish_reason stays ``stop``, as
  OpenAI answers.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.api.errors import APIError
from kvscale.server.api.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from kvscale.server.api.tool_parsers import (
    JsonArrayParser,
    Parsed,
    ParsedCall,
    ToolParser,
    get_parser,
)
from kvscale.server.structured.params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_ALNUM = string.ascii_letters + string.digits


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]] | None = None  # for the chat template
    parser: ToolParser | None = None  # reads tool calls from auto/required output
    named: str | None = None  # the forced function
    constraint: StructuredOutputsParams | None = None  # grammar of required/named
    id_style: str = "openai"  # "mistral": 9 alphanumerics, as Mistral templates need

    @property
    def reads_calls(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def new_id(self) -> str:
        if self.id_style == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema; 400 naming the tool at fault."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(400, "only tools of type 'function' are supported", f"tools.{i}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, "a tool needs a 'function' object", f"tools.{i}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(
                400,
                f"a function name must be 1-64 letters, digits, '_', '.' or '-'; got {name!r}",
                f"tools.{i}.function.name",
            )
        if name in out:
            raise APIError(400, f"function {name!r} is defined twice", f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise APIError(
                400, "function parameters must be a JSON schema object",
                f"tools.{i}.function.parameters",
            )  # fmt: skip
        out[name] = params
    return out


def required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: required`` output: an array of calls."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in functions.items()
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(req: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
    """How this request uses tools; 400 for a bad ``tools``/``tool_choice``, or for
    ``auto`` when the server has no tool-call parser."""
    tools = req.tools or None
    choice = req.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    functions = _functions(tools)
    if choice is None:
        choice = "auto"
    id_style = "mistral" if parser_name == "mistral" else "openai"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if parser_name is None:
            raise APIError(
                400,
                "tool_choice 'auto' needs a tool call parser: start the server with "
                "--tool-call-parser (hermes, llama3_json or mistral), or use a chat template "
                "whose tool-call format is known; or send tool_choice 'required' or a named "
                "function",
                param="tool_choice",
            )
        return ToolPlan("auto", tools, get_parser(parser_name), id_style=id_style)
    if choice == "required":
        schema = required_schema(functions, req.parallel_tool_calls is not False)
        constraint = StructuredOutputsParams(json=schema, param="tools")
        return ToolPlan("required", tools, JsonArrayParser(), None, constraint, id_style)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise APIError(
                400,
                "tool_choice must be none, auto, required or {type: function, function: "
                "{name: ...}}",
                param="tool_choice",
            )
        if name not in functions:
            raise APIError(
                400,
                f"tool_choice names function {name!r}, which is not in tools "
                f"({', '.join(functions)})",
                param="tool_choice.function.name",
            )
        constraint = StructuredOutputsParams(json=functions[name], param="tools")
        return ToolPlan("named", tools, None, name, constraint, id_style)
    raise APIError(
        400, f"tool_choice must be none, auto, required or a named function; got {choice!r}",
        param="tool_choice",
    )  # fmt: skip


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their ``arguments`` as objects (OpenAI sends JSON text;
    chat templates such as Qwen2.5's and Llama 3's serialize a mapping)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except json.JSONDecodeError:
                        pass
                    c = {**c, "function": fn}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def _parsed(plan: ToolPlan, text: str, final: bool) -> Parsed:
    if plan.mode == "named":
        return Parsed(None, [ParsedCall(plan.named, text, final)])
    assert plan.parser is not None
    return plan.parser.parse(text, final)


def message_parts(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall], str | None]:
    """The final message of one choice: its content, tool calls and finish reason."""
    if not plan.reads_calls:
        return text, [], finish_reason
    parsed = _parsed(plan, text, True)
    calls = [
        ToolCall(id=plan.new_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.calls
        if c.name is not None
    ]
    if calls and plan.mode != "named" and finish_reason == "stop":
        finish_reason = "tool_calls"
    return (parsed.content or None) if calls else (text or None), calls, finish_reason


@dataclass
class ToolStream:
    """What one streamed choice sent so far; ``delta`` gives the next delta's parts."""

    plan: ToolPlan
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)  # per call sent so far
    args_sent: list[int] = field(default_factory=list)

    def delta(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content and tool-call deltas (OpenAI's shape) for the text so far."""
        parsed = _parsed(self.plan, text, final)
        content = parsed.content or ""  # the parser holds back a tail that may start a call
        if final and not any(c.name is not None for c in parsed.calls):
            content = text  # no call after all (e.g. cut short): all of it is content
        new_content = content[self.content_sent :] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # its name is still arriving; later calls cannot have started
            if i >= len(self.ids):
                self.ids.append(self.plan.new_id())
                self.args_sent.append(0)
                deltas.append(
                    {
                        "index": i,
                        "id": self.ids[i],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            new_args = call.arguments[self.args_sent[i] :]
            if new_args:
                self.args_sent[i] = len(call.arguments)
                deltas.append({"index": i, "function": {"arguments": new_args}})
        return new_content, deltas

    @property
    def called(self) -> bool:
        return bool(self.ids)
