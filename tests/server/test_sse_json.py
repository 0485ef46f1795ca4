"""Every server-sent event is one line of JSON, whatever text a token decodes to."""

from __future__ import annotations

import json

from kvscale.server.api.errors import dumps
from kvscale.server.api.serving_common import sse


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
