"""What completions and chat share: sampling settings, context checks, submission,
disconnect handling and server-sent events."""

from __future__ import annotations

import asyncio
import hashlib
import math
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from kvscale.server.api.errors import APIError, dumps, param_of, sse_error
from kvscale.server.api.protocol import SamplingRequest
from kvscale.server.errors import InvalidRequestError
from kvscale.server.outputs import RequestOutput
from kvscale.server.process.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineRequest,
    EngineStalledError,
    EngineStepError,
    QueueFullError,
    RequestGroup,
    ServerShutdownError,
)
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.structured.params import StructuredOutputsParams

T = TypeVar("T")

MIN_TEMPERATURE = 0.01  # smaller positive temperatures are raised to this (as vLLM does)
LOGPROB_FLOOR = -9999.0  # JSON has no -inf
RETRY_AFTER_S = "1"  # Retry-After of a 429 (seconds)
MAX_SEQS_PER_REQUEST = 1024  # prompts x n in one request


def check_request_size(num_prompts: int, n: int) -> None:
    """400 for a request that asks for more than MAX_SEQS_PER_REQUEST sequences."""
    if num_prompts * n > MAX_SEQS_PER_REQUEST:
        raise APIError(
            400,
            f"a request may ask for at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n); "
            f"this one asks for {num_prompts} x {n}",
            param="n",
        )


def tokenize(engine: AsyncEngine, text: str, param: str, special: bool = True) -> list[int]:
    """Token ids of ``text``; 400 if the tokenizer cannot take it (e.g. lone surrogates)."""
    try:
        if special:
            return engine.tokenize(text)
        return list(engine.tokenizer.encode(text, add_special_tokens=False))
    except Exception as e:
        why = _untokenizable(text, e)
        raise APIError(400, f"cannot tokenize {param}: {why}", param=param) from e


def _untokenizable(text: str, err: Exception) -> str:
    """Why a tokenizer refused ``text``: an unpaired surrogate (JSON's "\ud800", no UTF-8
    to take) named where it is, else the tokenizer's own message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"it holds an unpaired UTF-16 surrogate ({text[e.start]!r} at character "
            f"{e.start}), not valid Unicode text"
        )
    return str(err)


async def tokenize_off_loop(
    engine: AsyncEngine, text: str, param: str, special: bool = True
) -> list[int]:
    """``tokenize`` on the engine's text threads (its time grows with the text's size)."""
    return await engine.off_loop(tokenize, engine, text, param, special)


def engine_error(e: BaseException) -> APIError:
    """The API error for a request the engine could not run (OpenAI's shape, typed code)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineStalledError):
        return APIError(503, str(e), code="engine_stalled", headers={"Retry-After": "5"})
    if isinstance(e, ServerShutdownError):
        return APIError(503, str(e), code="shutting_down", headers={"Connection": "close"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), code="engine_error")
    return APIError(500, str(e) or type(e).__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(x: float) -> float:
    return LOGPROB_FLOOR if math.isnan(x) or x < LOGPROB_FLOOR else float(x)


def resolve_max_tokens(
    max_tokens: int | None, prompt_len: int, max_model_len: int, param: str, prompt_param: str
) -> int:
    """Tokens to generate; 400 with both numbers when prompt + max_tokens exceed the context."""
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please "
            "shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if isinstance(max_tokens, int) and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            f"{param}.",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def logit_bias(req: SamplingRequest) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids; 400 for a key that is not one."""
    if not req.logit_bias:
        return None
    out: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        out[tok] = value
    return out


def sampling_params(
    req: SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    rename: dict[str, str] | None = None,
    structured: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The request's SamplingParams; a 400 naming the field for any bad value."""
    temperature = 1.0 if req.temperature is None else req.temperature
    if isinstance(temperature, float | int) and 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_k = 0 if req.top_k is None else req.top_k
    if top_k > vocab_size:
        top_k = vocab_size  # same distribution; keeps the value inside int64
    try:
        return SamplingParams(
            n=req.n,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured,
            logit_bias=logit_bias(req),
            prompt_logprobs=prompt_logprobs,
        )
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=param_of(e, rename)) from e


def check_stream_options(req: SamplingRequest) -> bool:
    """Whether a usage chunk ends the stream; 400 for stream_options without stream."""
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def cache_salt(req: SamplingRequest, raw: Request, per_key: bool) -> str | None:
    """The request's prefix-cache salt: its ``cache_salt``, joined (when ``per_key``) by a
    digest of its bearer token, so that requests of different keys never share blocks."""
    salt = req.cache_salt
    if not per_key:
        return salt
    auth = raw.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return salt
    digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return f"key:{digest}|{salt or ''}"


def submit(
    engine: AsyncEngine, requests: list[EngineRequest], prompt_param: str = "prompt"
) -> RequestGroup:
    """Queues requests; 400 for input the engine refuses (naming the field, the prompt as
    ``prompt_param``), 429 when the queue is full, 503 when the engine is down."""
    try:
        return engine.submit(requests)
    except QueueFullError as e:
        raise APIError(
            429, str(e), code="queue_full", headers={"Retry-After": RETRY_AFTER_S}
        ) from e
    except EngineDeadError as e:
        raise engine_error(e) from e
    except InvalidRequestError as e:
        param = param_of(e, {"prompt": prompt_param})
        raise APIError(400, str(e), param=param, code=e.code) from e


async def collect(group: RequestGroup) -> dict[str, RequestOutput]:
    """Runs a group to the end; returns the final output of each request. Closes it."""
    final: dict[str, RequestOutput] = {}
    try:
        async with group:
            async for out in group:
                final[out.request_id] = out
    except (EngineDeadError, EngineStepError) as e:
        raise engine_error(e) from e
    return final


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(awaitable: Awaitable[T], request: Request) -> T | None:
    """Awaits ``awaitable`` unless the client disconnects first: then cancels it (which
    aborts its requests) and returns None."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    try:
        await task
    except BaseException:
        pass
    return None


def sse(obj: Any) -> str:
    """One server-sent event."""
    return f"data: {dumps(obj)}\n\n"


class ChunkEvents:
    """The server-sent events of one stream's chunks, each with one choice: ``{"id", "object",
    "created", "model", "choices": [{"index", FIELD, "logprobs", "finish_reason",
    "stop_reason"}], ("usage": null)}``. The parts that never change are encoded once, so a
    chunk JSON-encodes only its own values: the text ``sse`` gives for the whole object
    (every value escaped on its own), at a fraction of its cost per token (NOTES e32)."""

    def __init__(
        self, rid: str, obj: str, created: int, model: str, field: str, include_usage: bool
    ) -> None:
        self._head = (
            f'data: {{"id":{dumps(rid)},"object":{dumps(obj)},"created":{int(created)},'
            f'"model":{dumps(model)},"choices":[{{"index":'
        )
        self._field = f',"{field}":'
        self._tail = "}]" + (',"usage":null' if include_usage else "") + "}\n\n"

    def __call__(self, index: int, value: Any, logprobs: Any, finish: Any, stop: Any) -> str:
        return (
            f"{self._head}{int(index)}{self._field}{dumps(value)},"
            f'"logprobs":{_or_null(logprobs)},"finish_reason":{_or_null(finish)},'
            f'"stop_reason":{_or_null(stop)}{self._tail}'
        )


def _or_null(value: Any) -> str:
    return "null" if value is None else dumps(value)


def sse_failure(e: BaseException) -> str:
    """The error event that ends a stream the engine could not finish."""
    err = engine_error(e)
    return sse_error(err.message, err.status, err.code)


SSE_DONE = "data: [DONE]\n\n"
