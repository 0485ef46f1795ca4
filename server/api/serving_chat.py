"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template.

Streams start each choice with a ``{"role": "assistant", "content": ""}`` delta, then
send content deltas (computed from the cumulative text already sent, so the stream
equals the non-streamed message) and end the choice with its ``finish_reason``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvscale.server.api import structured
from kvscale.server.api.errors import APIError, SafeJSONResponse
from kvscale.server.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    TopLogprob,
    UsageInfo,
)
from kvscale.server.api.serving_common import (
    SSE_DONE,
    ChunkEvents,
    cache_salt,
    check_stream_options,
    clamp_logprob,
    collect,
    random_id,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_failure,
    submit,
    tokenize,
    unless_disconnected,
)
from kvscale.server.api.state import ServerState
from kvscale.server.api.tools import (
    ToolPlan,
    ToolStream,
    message_parts,
    plan_tools,
    template_messages,
)
from kvscale.server.outputs import Logprob
from kvscale.server.process.async_engine import AsyncEngine, EngineRequest, RequestGroup


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> ChatLogprobs:
    """OpenAI's chat logprobs: each sampled token with its top ``k`` alternatives."""
    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(tid)
        tok = (sampled.decoded_token if sampled else None) or ""
        tops = sorted((e for e in entry.values() if e.rank <= k), key=lambda e: e.rank)
        content.append(
            ChatLogprobToken(
                token=tok,
                logprob=clamp_logprob(sampled.logprob) if sampled else -9999.0,
                bytes=_bytes(tok),
                top_logprobs=[
                    TopLogprob(
                        token=e.decoded_token or "",
                        logprob=clamp_logprob(e.logprob),
                        bytes=_bytes(e.decoded_token or ""),
                    )
                    for e in tops[:k]
                ],
            )
        )
    return ChatLogprobs(content=content)


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(req.messages):
        d: dict[str, Any] = {k: v for k, v in m.model_dump().items() if v is not None}
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise APIError(
                        400,
                        f"only text content parts are supported, got type {part.type!r}",
                        param=f"messages.{i}.content.{j}",
                    )
                if part.text is None:
                    raise APIError(
                        400,
                        "a text content part needs its 'text' field (a string)",
                        param=f"messages.{i}.content.{j}.text",
                    )
                texts.append(part.text)
            d["content"] = "\n".join(texts)
        elif content is None:
            d["content"] = ""
        out.append(d)
    return out


def render_prompt(
    engine: AsyncEngine,
    req: ChatCompletionRequest,
    template: str | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the messages (and ``tools``) rendered with the chat template; 400 if
    it cannot."""
    tok = engine.tokenizer
    if template is None and not getattr(tok, "chat_template", None):
        raise APIError(
            400,
            "this model has no chat template; use /v1/completions, or start the server with "
            "--chat-template",
            param="messages",
        )
    try:
        text = tok.apply_chat_template(
            template_messages(_messages(req)),
            tools=tools,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
    except APIError:
        raise
    except Exception as e:  # a template error is caused by the messages: bad input
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
    if not isinstance(text, str):
        raise APIError(400, "the chat template did not render to text", param="messages")
    ids = tokenize(engine, text, "messages", special=False)
    return ids


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, raw: Request
) -> Response:
    engine = state.require_engine()
    model = state.check_model(req.model)
    _check_unsupported(req)
    include_usage = check_stream_options(req)
    plan = plan_tools(req, state.tool_parser())
    constraint = structured.requested(req)
    if plan.constraint is not None:
        if constraint is not None:
            raise APIError(
                400,
                f"tool_choice {req.tool_choice!r} forces a tool call; it cannot be combined "
                f"with {constraint.param}",
                param="tool_choice",
            )
        constraint = plan.constraint
    constraint = await structured.checked(constraint)
    # Off the event loop: rendering and tokenizing take time that grows with the messages.
    ids = await engine.off_loop(
        render_prompt, engine, req, state.settings.chat_template, plan.tools
    )
    mt_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = resolve_max_tokens(requested, len(ids), engine.max_model_len, mt_param, "messages")
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(
        req,
        max_tokens,
        k,
        engine.vocab_size,
        {"logprobs": "top_logprobs", "max_tokens": mt_param},
        structured=constraint,
    )
    rid = random_id("chatcmpl")
    salt = cache_salt(req, raw, state.settings.prefix_cache_salt_per_key)
    group = submit(engine, [EngineRequest(rid, ids, params, salt)], prompt_param="messages")
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            _stream(group, rid, model, created, k, include_usage, plan),
            media_type="text/event-stream",
        )
    final = await unless_disconnected(collect(group), raw)
    if final is None:
        return Response(status_code=499)
    out = final[rid]
    choices = []
    for c in out.outputs:
        logprobs = None
        if k is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, k)
        content, tool_calls, finish = message_parts(plan, c.text, c.finish_reason)
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                logprobs=logprobs,
                finish_reason=finish,
                stop_reason=c.stop_reason,
            )
        )
    pt, ct = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    usage = UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)
    body = ChatCompletionResponse(
        id=rid, created=created, model=model, choices=choices, usage=usage
    )
    return SafeJSONResponse(body.model_dump())


async def _stream(
    group: RequestGroup,
    rid: str,
    model: str,
    created: int,
    k: int | None,
    include_usage: bool,
    plan: ToolPlan | None = None,
) -> AsyncIterator[str]:
    tool_streams: dict[int, ToolStream] = {}
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    started: set[int] = set()
    done: set[int] = set()  # choices whose finish chunk was sent
    usage = UsageInfo()

    chunk = ChunkEvents(rid, "chat.completion.chunk", created, model, "delta", include_usage)

    try:
        async for out in group:
            usage.prompt_tokens = len(out.prompt_token_ids)
            usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            for c in out.outputs:
                i = c.index
                if i in done:  # outputs are cumulative: a finished choice comes again
                    continue
                if i not in started:
                    started.add(i)
                    yield chunk(i, {"role": "assistant", "content": ""}, None, None, None)
                tool_deltas: list[dict[str, Any]] = []
                finish = c.finish_reason
                if plan is not None and plan.reads_calls:
                    ts = tool_streams.setdefault(i, ToolStream(plan))
                    delta, tool_deltas = ts.delta(c.text, c.finished)
                    if ts.called and plan.mode != "named" and finish == "stop":
                        finish = "tool_calls"
                else:
                    start = sent_text.get(i, 0)
                    delta = c.text[start:] if len(c.text) > start else ""
                    sent_text[i] = max(start, len(c.text))
                if not delta and not tool_deltas and not c.finished:
                    continue
                if c.finished:
                    done.add(i)
                logprobs = None
                if k is not None and c.logprobs is not None:
                    t0 = sent_tokens.get(i, 0)
                    logprobs = chat_logprobs(c.token_ids[t0:], c.logprobs[t0:], k).model_dump()
                    sent_tokens[i] = len(c.token_ids)
                body: dict[str, Any] = {"content": delta} if delta else {}
                if tool_deltas:
                    body["tool_calls"] = tool_deltas
                yield chunk(i, body, logprobs, finish, c.stop_reason)
        if include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage.model_dump(),
                }
            )
    except Exception as e:  # the engine failed mid-stream: tell the client, then end
        yield sse_failure(e)
    finally:
        group.close()
    yield SSE_DONE
