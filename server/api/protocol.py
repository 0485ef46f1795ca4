"""Request and response bodies of the OpenAI-compatible API (with vLLM's extra fields).

Unknown request fields are ignored, as vLLM does. Ranges are checked by
``SamplingParams`` (a 400 naming the field); the bounds here only keep a request from
asking for absurd amounts of work (``n`` <= 128, a seed that fits in 64 bits).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # OpenAI's limit on choices per request


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResponseFormat(_Request):
    type: str = Field(description="text | json_object | json_schema")
    json_schema: dict[str, Any] | None = Field(
        None, description="{name, description, schema, strict}: the schema the output follows"
    )


class StructuredOutputsField(_Request):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="a served model name; default: the first")
    n: int = Field(1, ge=1, le=MAX_N, description="choices to generate for each prompt")
    temperature: float | None = Field(None, description="0 = greedy; default 1")
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, description="0 or -1 = off")
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="prefix-cache isolation: requests share cached KV blocks only with "
        "requests of the same salt",
    )
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = Field(
        None, description="text | json_object | json_schema (with json_schema.schema)"
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="a JSON schema")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(None, description="an EBNF (GBNF) or Lark grammar")
    structured_outputs: StructuredOutputsField | None = None


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists"
    )
    max_tokens: int | None = Field(
        16, description="null = up to the context length; 0 (with echo) = score the prompt only"
    )
    echo: bool | None = False
    logprobs: int | None = Field(
        None, description="top log-probabilities per token, 0..20 (of the prompt too with echo)"
    )
    prompt_logprobs: int | None = Field(
        None, description="vLLM: top log-probabilities per prompt token"
    )
    best_of: int | None = Field(None, description="must equal n if given")
    suffix: str | None = Field(None, description="not supported")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, description="null = up to the context length")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, description="0..20; needs logprobs=true")
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="functions the model may call: {type: function, function: {name, "
        "description, parameters}}",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description="none | auto (default with tools) | required | {type: function, "
        "function: {name}}",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call")
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# ---- responses ---------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize``: a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages"
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvscale"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
