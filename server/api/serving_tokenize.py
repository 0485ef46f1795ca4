"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the server's tokenizer, with the
chat template for messages, so clients count tokens exactly as generation will."""

from __future__ import annotations

import functools

from kvscale.server.api.errors import APIError
from kvscale.server.api.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from kvscale.server.api.serving_chat import render_prompt
from kvscale.server.api.serving_common import tokenize as tokenize_text
from kvscale.server.api.state import ServerState
from kvscale.server.process.async_engine import AsyncEngine


async def tokenize(state: ServerState, req: TokenizeRequest) -> TokenizeResponse:
    """Runs on the engine's text threads: the work grows with the client's text."""
    engine = state.require_engine()
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    return await engine.off_loop(_tokenize, state, engine, req)


def _tokenize(state: ServerState, engine: AsyncEngine, req: TokenizeRequest) -> TokenizeResponse:
    if req.messages is not None:
        chat = ChatCompletionRequest(
            messages=req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            tools=req.tools,
        )
        ids = render_prompt(engine, chat, state.settings.chat_template, req.tools)
        if req.add_special_tokens:  # the template usually writes BOS itself
            bos = engine.tokenizer.bos_token_id
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
    else:
        assert req.prompt is not None
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenize_text(engine, req.prompt, "prompt", special=special)
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs
    )


async def detokenize(state: ServerState, req: DetokenizeRequest) -> DetokenizeResponse:
    engine = state.require_engine()
    state.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
    if bad:
        raise APIError(
            400,
            f"token ids must be in [0, {engine.vocab_size}); got {bad[:5]}",
            param="tokens",
        )
    decode = functools.partial(engine.tokenizer.decode, skip_special_tokens=False)
    text = await engine.off_loop(decode, req.tokens)
    return DetokenizeResponse(prompt=text)
