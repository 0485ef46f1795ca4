"""``POST /v1/completions``: prompts in, text (streamed or not) out.

A request may carry several prompts (strings or token ids); each becomes one engine
request with ``n`` choices, numbered ``prompt_index * n + choice``. Streams send each
choice's new text as its own chunk, computed from the cumulative text already sent, so
the concatenated stream equals the non-streamed text (a possible stop string is held
back by the engine until it can no longer be one).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvscale.server.api import structured
from kvscale.server.api.errors import APIError, SafeJSONResponse
from kvscale.server.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from kvscale.server.api.serving_common import (
    SSE_DONE,
    ChunkEvents,
    cache_salt,
    check_request_size,
    check_stream_options,
    clamp_logprob,
    collect,
    random_id,
    resolve_max_tokens,
    sampling_params,
    sse,
    sse_failure,
    submit,
    tokenize_off_loop,
    unless_disconnected,
)
from kvscale.server.api.state import ServerState
from kvscale.server.outputs import CompletionOutput, Logprob, RequestOutput
from kvscale.server.process.async_engine import AsyncEngine, EngineRequest, RequestGroup


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob]], k: int, offset: int
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs for ``token_ids``; returns them and the next text offset.

    ``top_logprobs`` holds the sampled token and the top ``k`` (vLLM's convention)."""
    lp = CompletionLogprobs()
    for tid, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(tid)
        tok = (sampled.decoded_token if sampled else None) or ""
        lp.tokens.append(tok)
        lp.token_logprobs.append(clamp_logprob(sampled.logprob) if sampled else None)
        top = {tok: clamp_logprob(sampled.logprob)} if sampled else {}
        for t, e in entry.items():
            if t != tid and e.rank <= k:
                top.setdefault(e.decoded_token or "", clamp_logprob(e.logprob))
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(tok)
    return lp, offset


def prompt_logprobs_part(
    prompt_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    k: int,
    first_token: str,
) -> tuple[CompletionLogprobs, int]:
    """The echoed prompt's share of OpenAI's legacy logprobs: the first token's logprob
    and top_logprobs are null (nothing precedes it); returns them and the next offset."""
    lp, offset = completion_logprobs(
        prompt_ids[1:], [e or {} for e in entries[1:]], k, len(first_token)
    )
    lp.tokens.insert(0, first_token)
    lp.token_logprobs.insert(0, None)
    lp.top_logprobs.insert(0, None)
    lp.text_offset.insert(0, 0)
    return lp, offset


def _join(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        text_offset=a.text_offset + b.text_offset,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        tokens=a.tokens + b.tokens,
        top_logprobs=a.top_logprobs + b.top_logprobs,
    )


def _vllm_prompt_logprobs(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[str, dict[str, object]] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, token id -> logprob, rank,
    decoded token (the first token's entry is null)."""
    if entries is None:
        return None
    return [
        None
        if e is None
        else {
            str(t): {
                "logprob": clamp_logprob(x.logprob),
                "rank": x.rank,
                "decoded_token": x.decoded_token,
            }
            for t, x in e.items()
        }
        for e in entries
    ]


async def _prompts(
    req: CompletionRequest, engine: AsyncEngine
) -> tuple[list[list[int]], list[str]]:
    """Token ids of each prompt, and its text (for echo)."""
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        raw = [list(p)]  # type: ignore[arg-type]
    else:
        raw = list(p)  # type: ignore[arg-type]
    if not raw:
        raise APIError(400, "prompt must not be empty", param="prompt")
    check_request_size(len(raw), req.n)
    ids_list, texts = [], []
    for item in raw:
        if isinstance(item, str):
            ids = await tokenize_off_loop(engine, item, "prompt")
        else:
            ids = list(item)
        ids_list.append(ids)
        texts.append(item if isinstance(item, str) else "")
    return ids_list, texts


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
    if req.max_tokens is not None and req.max_tokens < 0:
        raise APIError(400, f"max_tokens must be >= 0, got {req.max_tokens}", param="max_tokens")


def _prompt_k(req: CompletionRequest) -> int | None:
    """Top-k of the prompt logprobs to compute: ``logprobs`` with echo, or vLLM's
    ``prompt_logprobs``."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if req.echo and req.logprobs is not None else None


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    engine = state.require_engine()
    model = state.check_model(req.model)
    _check_unsupported(req)
    include_usage = check_stream_options(req)
    constraint = await structured.checked(structured.requested(req))
    prompts, texts = await _prompts(req, engine)
    vocab = engine.vocab_size
    rid = random_id("cmpl")
    score_only = req.max_tokens == 0  # the engine samples one token, which is dropped
    prompt_k = _prompt_k(req)
    reqs = []
    for i, ids in enumerate(prompts):
        max_tokens = resolve_max_tokens(
            1 if score_only else req.max_tokens,
            len(ids),
            engine.max_model_len,
            "max_tokens",
            "prompt",
        )
        params = sampling_params(
            req,
            max_tokens,
            req.logprobs,
            vocab,
            structured=constraint,
            prompt_logprobs=prompt_k,
        )
        salt = cache_salt(req, raw, state.settings.prefix_cache_salt_per_key)
        reqs.append(EngineRequest(f"{rid}-{i}", ids, params, salt))
    echo = None
    if req.echo:
        echo = [
            t or await engine.off_loop(engine.detokenize, ids)
            for t, ids in zip(texts, prompts, strict=True)
        ]
    group = submit(engine, reqs)
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            _stream(group, rid, model, created, req, echo, include_usage, engine),
            media_type="text/event-stream",
        )
    final = await unless_disconnected(collect(group), raw)
    if final is None:  # the client went away; its requests were aborted
        return Response(status_code=499)
    choices, usage = [], UsageInfo()
    for i, r in enumerate(reqs):
        out = final[r.request_id]
        usage.prompt_tokens += len(out.prompt_token_ids)
        for c in out.outputs:
            if score_only:
                c = CompletionOutput(c.index, "", [], "length", None, [])
            usage.completion_tokens += len(c.token_ids)
            choices.append(
                _choice(i * req.n + c.index, c, req, echo[i] if echo else "", out, engine)
            )
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    body = CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage)
    return SafeJSONResponse(body.model_dump())


def _echo_logprobs(
    req: CompletionRequest, out: RequestOutput, engine: AsyncEngine
) -> tuple[CompletionLogprobs, int] | None:
    """The echoed prompt's logprobs (with echo and logprobs), and the offset after it."""
    if not (req.echo and req.logprobs is not None and out.prompt_logprobs is not None):
        return None
    ids = out.prompt_token_ids
    first = engine.processor.token_text(ids[0])
    return prompt_logprobs_part(ids, out.prompt_logprobs, req.logprobs, first)


def _choice(
    index: int,
    c: CompletionOutput,
    req: CompletionRequest,
    prefix: str,
    out: RequestOutput,
    engine: AsyncEngine,
) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None and c.logprobs is not None:
        echoed = _echo_logprobs(req, out, engine)
        offset = echoed[1] if echoed else 0
        logprobs, _ = completion_logprobs(c.token_ids, c.logprobs, req.logprobs, offset)
        if echoed:
            logprobs = _join(echoed[0], logprobs)
    return CompletionChoice(
        index=index,
        text=prefix + c.text,
        logprobs=logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        prompt_logprobs=_vllm_prompt_logprobs(out.prompt_logprobs)
        if req.prompt_logprobs is not None
        else None,
    )


async def _stream(
    group: RequestGroup,
    rid: str,
    model: str,
    created: int,
    req: CompletionRequest,
    echo: list[str] | None,
    include_usage: bool,
    engine: AsyncEngine,
) -> AsyncIterator[str]:
    n = req.n
    score_only = req.max_tokens == 0
    # with logprobs, an echoed prompt is sent once its logprobs are known (first output)
    echo_later = bool(echo) and req.logprobs is not None
    echoed: set[int] = set()
    index_of = {r: i for i, r in enumerate(group.request_ids)}
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    prompt_tokens: dict[str, int] = {}
    completion_tokens: dict[int, int] = {}
    done: set[int] = set()  # choices whose finish chunk was sent

    chunk = ChunkEvents(rid, "text_completion", created, model, "text", include_usage)

    try:
        if echo and not echo_later:
            for p, text in enumerate(echo):
                for j in range(n):
                    yield chunk(p * n + j, text, None, None, None)
        async for out in group:
            p = index_of[out.request_id]
            prompt_tokens[out.request_id] = len(out.prompt_token_ids)
            if echo and echo_later and p not in echoed:
                echoed.add(p)
                part = _echo_logprobs(req, out, engine)
                for j in range(n):
                    if part is not None:
                        offsets[p * n + j] = part[1]
                    lp_dump = part[0].model_dump() if part is not None else None
                    yield chunk(p * n + j, echo[p], lp_dump, None, None)
            for c in out.outputs:
                idx = p * n + c.index
                if idx in done:  # outputs are cumulative: a finished choice comes again
                    continue
                if score_only:
                    if c.finished:
                        done.add(idx)
                        yield chunk(idx, "", None, "length", None)
                    continue
                completion_tokens[idx] = len(c.token_ids)
                start = sent_text.get(idx, 0)
                delta = c.text[start:] if len(c.text) > start else ""
                if not delta and not c.finished:
                    continue
                if c.finished:
                    done.add(idx)
                sent_text[idx] = max(start, len(c.text))
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    t0 = sent_tokens.get(idx, 0)
                    lp, offsets[idx] = completion_logprobs(
                        c.token_ids[t0:], c.logprobs[t0:], req.logprobs, offsets.get(idx, 0)
                    )
                    sent_tokens[idx] = len(c.token_ids)
                    logprobs = lp.model_dump()
                yield chunk(idx, delta, logprobs, c.finish_reason, c.stop_reason)
        if include_usage:
            pt, ct = sum(prompt_tokens.values()), sum(completion_tokens.values())
            usage = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
            yield sse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
            )
    except Exception as e:  # the engine failed mid-stream: tell the client, then end
        yield sse_failure(e)
    finally:
        group.close()
    yield SSE_DONE
