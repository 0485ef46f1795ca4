"""Tool calls read from model-formatted text, one table row per format and case, and the
stream's deltas adding up to the final message whatever the chunking."""

from __future__ import annotations

import json

import pytest

from kvscale.server.api.tool_parsers import detect_parser, get_parser, scan_value
from kvscale.server.api.tools import ToolPlan, ToolStream, message_parts

W = '{"city": "Paris", "days": 3}'
T = '{"q": "a \\"quoted\\" }{ brace", "n": [1, {"x": null}]}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", "plain answer", "plain answer", []),
    ("hermes", f'<tool_call>\n{{"name": "weather", "arguments": {W}}}\n</tool_call>', None,
     [("weather", W)]),
    ("hermes", f'Let me look.<tool_call>{{"name": "weather", "arguments": {W}}}</tool_call>'
     f'<tool_call>{{"name": "search", "arguments": {T}}}</tool_call>', "Let me look.",
     [("weather", W), ("search", T)]),
    ("hermes", '<tool_call>{"arguments": {}, "name": "noargs"}</tool_call>', None,
     [("noargs", "{}")]),
    ("llama3_json", f'{{"name": "weather", "parameters": {W}}}', None, [("weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "weather", "parameters": {W}}}; '
     f'{{"name": "search", "parameters": {T}}}', None, [("weather", W), ("search", T)]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("llama3_json", '{"answer": 4}', '{"answer": 4}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "weather", "arguments": {W}}}, '
     f'{{"name": "search", "arguments": {T}}}]', None, [("weather", W), ("search", T)]),
    ("mistral", f"Sure. [TOOL_CALLS]weather[ARGS]{W}[TOOL_CALLS]search[ARGS]{T}", "Sure. ",
     [("weather", W), ("search", T)]),
    ("mistral", "no calls here", "no calls here", []),
    ("json_array", f'[{{"name": "weather", "parameters": {W}}}]', None, [("weather", W)]),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_parse_each_format(parser: str, text: str, content: str | None, calls: list) -> None:
    parsed = get_parser(parser).parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert all(c.complete for c in parsed.calls)
    for _, args in calls:
        json.loads(args)  # the arguments are the model's JSON text


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_deltas_add_up_to_the_message(
    parser: str, text: str, content: str | None, calls: list, step: int
) -> None:
    mode = "required" if parser == "json_array" else "auto"
    plan = ToolPlan(mode, [], get_parser(parser))
    stream = ToolStream(plan)
    got_content = ""
    got: dict[int, dict[str, str]] = {}
    for end in [*range(step, len(text), step), len(text)]:
        delta, tool_deltas = stream.delta(text[:end], final=end == len(text))
        got_content += delta
        for d in tool_deltas:
            call = got.setdefault(d["index"], {"name": "", "arguments": ""})
            call["name"] += d["function"].get("name") or ""
            call["arguments"] += d["function"].get("arguments") or ""
    msg_content, msg_calls, finish = message_parts(plan, text, "stop")
    assert got_content == (msg_content or "")
    assert [(c["name"], c["arguments"]) for c in got.values()] == [
        (c.function.name, c.function.arguments) for c in msg_calls
    ]
    assert finish == ("tool_calls" if calls else "stop")


def test_partial_text_holds_back_a_marker_and_streams_arguments() -> None:
    p = get_parser("hermes")
    assert p.parse("Hello <tool_", final=False).content == "Hello "
    assert p.parse("Hello <tool_", final=True).content == "Hello <tool_"
    part = p.parse('<tool_call>{"name": "weather", "arguments": {"city": "Pa', final=False)
    assert part.calls[0].name == "weather" and part.calls[0].arguments == '{"city": "Pa'
    assert not part.calls[0].complete
    assert get_parser("llama3_json").parse('{"na', final=False).calls[0].name is None


def test_named_function_output_is_the_arguments() -> None:
    plan = ToolPlan("named", [], None, "weather")
    content, calls, finish = message_parts(plan, W, "stop")
    assert content is None and finish == "stop"
    assert [(c.function.name, c.function.arguments) for c in calls] == [("weather", W)]


def test_scan_value_finds_the_end_of_json_values() -> None:
    assert scan_value(T + "tail", 0) == len(T)
    assert scan_value('"a\\"b" x', 0) == 6
    assert scan_value("12, 3", 0) == 2
    assert scan_value('{"a": [1, 2', 0) is None


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("... <tool_call>{{ tool }}</tool_call> ...", "hermes"),
        ("{% if tools %}[AVAILABLE_TOOLS]...[TOOL_CALLS]{% endif %}", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>{% if tools %}<|python_tag|>", "llama3_json"),
        ("{{ bos_token }}[INST] {{ message['content'] }} [/INST]", None),
        (None, None),
    ],
)
def test_parser_chosen_from_the_chat_template(template: str | None, parser: str | None) -> None:
    assert detect_parser(template) == parser


def test_mistral_ids_are_nine_alphanumerics() -> None:
    plan = ToolPlan("auto", [], get_parser("mistral"), id_style="mistral")
    _, calls, _ = message_parts(plan, f"[TOOL_CALLS]weather[ARGS]{W}", "stop")
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", 'Hi <tool_call>{"name": "weath'),
        ("mistral", "Hi [TOOL_CALLS]weath"),
        ("llama3_json", '{"na'),
    ],
)
def test_output_cut_before_a_call_has_a_name_is_content(parser: str, text: str) -> None:
    plan = ToolPlan("auto", [], get_parser(parser))
    content, calls, finish = message_parts(plan, text, "length")
    assert (content, calls, finish) == (text, [], "length")
    stream = ToolStream(plan)
    sent = "".join(
        stream.delta(text[:end], final=end == len(text))[0] for end in range(1, len(text) + 1)
    )
    assert sent == text and not stream.called
