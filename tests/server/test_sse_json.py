"""Every server-sent event is one line of JSON, whatever text a token decodes to."""

from __future__ import annotations

import json

from kvscale.server.api.errors import dumps
from kvscale.server.api.serving_common import ChunkEvents, sse


def test_events_stay_on_one_line_for_any_line_separator() -> None:
    text = "a\u2028b\u2029c\x85d\x0be\x1cf\nG\r"
    event = sse({"choices": [{"text": text}]})
    body = event.removesuffix("\n\n")
    assert len(body.splitlines()) == 1 and body.startswith("data: ")
    assert json.loads(body[len("data: ") :])["choices"][0]["text"] == text


def test_lone_surrogates_fall_back_to_ascii_json() -> None:
    out = dumps({"t": "x\ud800y\u2028"})
    out.encode("utf-8")  # encodable: escaped
    assert json.loads(out) == {"t": "x\ud800y\u2028"} and len(out.splitlines()) == 1


def _whole(rid: str, obj: str, model: str, field: str, usage: bool, args: tuple) -> dict:
    index, value, logprobs, finish, stop = args
    choice = {"index": index, field: value, "logprobs": logprobs, "finish_reason": finish,
              "stop_reason": stop}  # fmt: skip
    return {"id": rid, "object": obj, "created": 1700000000, "model": model,
            "choices": [choice], **({"usage": None} if usage else {})}  # fmt: skip


def test_chunk_events_are_the_events_of_the_whole_chunk() -> None:
    """A stream's chunks from the template: byte for byte what ``sse`` makes of the whole
    chunk object, and one line of the same JSON where a value needs escaping alone."""
    lp = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}
    cases = [
        (0, "Hello", None, None, None),
        (3, " wörld 😀", lp, "stop", 2),
        (1, "", None, "length", "</s>"),
        (2, {"role": "assistant", "content": ""}, None, None, None),
        (0, {"content": "x", "tool_calls": [{"index": 0, "id": "c"}]}, None, "tool_calls", None),
    ]
    for obj, field in (("text_completion", "text"), ("chat.completion.chunk", "delta")):
        for usage in (False, True):
            events = ChunkEvents("cmpl-1", obj, 1700000000, 'm "q"', field, usage)
            for args in cases:
                assert events(*args) == sse(_whole("cmpl-1", obj, 'm "q"', field, usage, args))
    events = ChunkEvents("cmpl-1", "text_completion", 1700000000, "m", "text", True)
    for text in ("a\u2028b\x85c\nd", "x\ud800y"):  # line breaks; a lone surrogate
        event = events(0, text, None, None, None)
        body = event.removesuffix("\n\n")
        assert event.endswith("\n\n") and len(body.splitlines()) == 1, event
        want = _whole("cmpl-1", "text_completion", "m", "text", True, (0, text, None, None, None))
        assert json.loads(body.removeprefix("data: ")) == want
