"""The leading token ids of a request, as the server will see them: completions prompts
tokenized as the engine tokenizes them (BOS included; token-id prompts as sent), chat
messages rendered with the server's own chat rendering (``render_prompt``), and the
prefix-cache salt the server will apply (``cache_salt``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from starlette.requests import Request

from kvscale.server.api.protocol import ChatCompletionRequest
from kvscale.server.api.serving_chat import render_prompt
from kvscale.server.api.serving_common import cache_salt
from kvscale.server.tokenizer import load_tokenizer


class PromptTokenizer:
    """The server's tokenizer and chat template, with the two methods ``render_prompt``
    uses of the engine (``tokenizer`` and ``tokenize``)."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        self.tokenizer = load_tokenizer(path)
        self.chat_template = chat_template

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        return prompt_token_ids(path, body, self)


def prompt_token_ids(
    path: str, body: dict[str, Any], tok: PromptTokenizer | None
) -> list[int] | None:
    """The prompt's token ids (the first prompt of a batch), or None when the body is not
    one the server would run (the server answers it; any replica will do) or, without a
    tokenizer ``tok``, when the prompt is text."""
    if path.endswith("/chat/completions"):
        if tok is None:
            return None
        try:
            req = ChatCompletionRequest.model_validate(body)
            return render_prompt(tok, req, tok.chat_template, req.tools or None)  # type: ignore[arg-type]
        except Exception:
            return None
    if path.endswith("/completions"):
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            p = p[0]  # a batch: route by its first prompt
        if isinstance(p, str):
            if tok is None:
                return None
            try:
                return tok.tokenize(p)
            except Exception:
                return None
        if isinstance(p, list) and p and all(type(t) is int for t in p):
            return p
    return None


def parse_body(raw: bytes) -> dict[str, Any] | None:
    """The JSON object of a request body, or None."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def request_salt(body: dict[str, Any], request: Request, per_key: bool) -> str | None:
    """The salt the server will hash the first block with (``--prefix-cache-salt-per-key``
    as on the servers)."""
    salt = body.get("cache_salt")

    class _Req:
        cache_salt = salt if isinstance(salt, str) else None

    return cache_salt(_Req(), request, per_key)  # type: ignore[arg-type]
