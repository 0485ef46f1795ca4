"""Structured outputs, tool calls, logit_bias, prompt logprobs and /tokenize through the
real server and the ``openai`` client (and lm-evaluation-harness), on a random-weight
checkpoint: the grammar, not the model, makes the outputs valid."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.hf_reference import token_in_text

from .conftest import ServerProcess

DATA = Path(__file__).parent / "data"
MAX_MODEL_LEN = 512
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "string", "enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "not sure"]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    # the chat template renders tools Hermes-style: the tool-call parser comes from it
    return start_server(
        llama_ckpt,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--chat-template", str(DATA / "hermes_tools.jinja"),
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(llama_ckpt: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_ckpt))


def _msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- structured outputs: a batch mixing constrained and free requests -------------------------
def _requests(tokenizer: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, endpoint, body) of a mixed batch."""
    quote, brace = tokenizer.convert_tokens_to_ids('"'), tokenizer.convert_tokens_to_ids("}")
    short = {str(quote): 6, str(brace): 6}  # random weights write endless strings otherwise
    schema_rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    return [
        ("json", "chat", dict(messages=_msgs("Who?"), response_format=schema_rf, temperature=0)),
        ("json", "chat", dict(messages=_msgs("Who else?"), response_format=schema_rf, seed=3)),
        ("json", "completions", dict(prompt="A person:", seed=4,
                                     extra_body=dict(response_format=schema_rf))),
        ("json", "completions", dict(prompt="Person", extra_body=dict(guided_json=PERSON))),
        ("object", "chat", dict(messages=_msgs("An object"), temperature=0, logit_bias=short,
                                response_format={"type": "json_object"})),
        ("regex", "completions", dict(prompt="Code:", extra_body=dict(guided_regex=REGEX))),
        ("regex", "chat", dict(messages=_msgs("Code?"),
                               extra_body=dict(structured_outputs={"regex": REGEX}))),
        ("choice", "chat", dict(messages=_msgs("Well?"), extra_body=dict(guided_choice=CHOICES))),
        ("free", "chat", dict(messages=_msgs("Talk"), max_tokens=16)),
        ("free", "completions", dict(prompt="Once upon a time", max_tokens=16, seed=9)),
    ]  # fmt: skip


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES


async def _run_one(
    aclient: openai.AsyncOpenAI, endpoint: str, body: dict[str, Any], stream: bool
) -> tuple[str, str | None]:
    body = {"model": "tiny", "max_tokens": 128, **body}
    if endpoint == "chat":
        if not stream:
            r = await aclient.chat.completions.create(**body)
            return r.choices[0].message.content or "", r.choices[0].finish_reason
        text, finish = "", None
        async for chunk in await aclient.chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        return text, finish
    if not stream:
        r = await aclient.completions.create(**body)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await aclient.completions.create(**body, stream=True):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_mixed_batch_outputs_are_valid(server: ServerProcess, tokenizer: Any, stream: bool) -> None:
    reqs = _requests(tokenizer)

    async def run() -> list[tuple[str, str | None]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        async with aclient:
            return await asyncio.gather(*(_run_one(aclient, e, b, stream) for _, e, b in reqs))

    results = asyncio.run(run())
    for (kind, endpoint, _), (text, finish) in zip(reqs, results, strict=True):
        if kind == "free":
            assert finish == "length" or finish == "stop"
            continue
        assert finish == "stop", (kind, endpoint, text)
        _check(kind, text)


def test_streamed_equals_non_streamed_under_a_grammar(client: openai.OpenAI) -> None:
    body = dict(
        model="tiny", prompt="P", max_tokens=128, seed=7, extra_body={"guided_json": PERSON}
    )
    full = client.completions.create(**body).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**body, stream=True))
    assert streamed == full
    jsonschema.validate(json.loads(full), PERSON)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}},
         "response_format.json_schema", 'Unsupported type "objec"'),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema", "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"guided_regex": "(abc"}, "guided_regex", "parenthesis"),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar", 'Rule "foo" is not defined'),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "vocab size"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_problem(
    server: ServerProcess, body: dict[str, Any], param: str, fragment: str
) -> None:
    for path, base in (
        ("/v1/chat/completions", {"messages": _msgs("hi")}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(f"{server.url}{path}", json={**base, **body, "max_tokens": 4}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param
        assert fragment in err["message"], err["message"]


# ---- tool calls ---------------------------------------------------------------------------------
def _stream_tool_calls(stream: Any) -> tuple[str, list[tuple[str, str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [(c["id"], c["name"], c["arguments"]) for c in calls.values()], finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_streamed_and_not(client: openai.OpenAI, tool_choice: Any) -> None:
    body = dict(
        model="tiny",
        messages=_msgs("What is the weather in Paris?"),
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=1.0,
        seed=11,
    )
    r = client.chat.completions.create(**body)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    if tool_choice == "required":
        assert finish == "tool_calls" and msg.content is None
    else:
        assert call.function.name == "get_time" and finish == "stop"
    content, calls, s_finish = _stream_tool_calls(
        client.chat.completions.create(**body, stream=True)
    )
    assert content == "" and s_finish == finish
    assert [(n, a) for _, n, a in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0][0].startswith("call_")


def test_tool_choice_auto_none_and_history(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model="tiny", messages=_msgs("Hi"), tools=TOOLS, tool_choice=choice, max_tokens=8
        )
        # random weights never write <tool_call>: the text is content
        assert r.choices[0].message.tool_calls in (None, []) and r.choices[0].message.content
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(
            model="tiny",
            messages=_msgs("Hi"),
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        client.chat.completions.create(model="tiny", messages=_msgs("Hi"), tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(
            model="tiny",
            messages=_msgs("Hi"),
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )


# ---- logit_bias ------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans(
    client: openai.OpenAI, llama_ckpt: Path, tokenizer: Any, temperature: float
) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [1, 415, 2936, 9060]
    body = dict(model="tiny", prompt=prompt, temperature=temperature, seed=2, logprobs=0)
    forced = client.completions.create(**body, max_tokens=5, logit_bias={"1234": 100})
    assert forced.choices[0].logprobs.tokens == [token_in_text(tokenizer, 1234)] * 5
    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)
    with torch.no_grad():
        order = model(torch.tensor([prompt])).logits[0, -1].argsort(descending=True).tolist()
    banned = order[:200]  # the model's 200 likeliest next tokens
    out = client.completions.create(
        **body, max_tokens=1, logit_bias={str(t): -100 for t in banned}
    ).choices[0]
    if temperature == 0:
        assert out.logprobs.tokens == [token_in_text(tokenizer, order[200])]
    else:
        assert out.logprobs.tokens[0] not in {token_in_text(tokenizer, t) for t in banned}


# ---- prompt logprobs --------------------------------------------------------------------------
def test_echo_logprobs_equal_transformers(client: openai.OpenAI, llama_ckpt: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [1, 415, 2936, 9060, 285, 1142, 28705, 13, 2287, 1781]
    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [lp[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    score = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    c = score.choices[0]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.tokens) == len(prompt) and c.finish_reason == "length"
    assert (
        score.usage.completion_tokens == 0
        and c.text
        == client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
        .choices[0]
        .text
    )
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset == sorted(
        c.logprobs.text_offset
    )
    # generating too: the prompt's part is the same, computed in the same prefill
    gen = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0
    ).choices[0]
    assert len(gen.logprobs.token_logprobs) == len(prompt) + 3
    assert gen.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(want, abs=1e-4)
    assert all(len(t) >= 2 for t in gen.logprobs.top_logprobs[1:])
    # streamed: the echoed prompt and its logprobs come first, then the generated tokens
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    tokens = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    lps = [x for ch in chunks for c in ch.choices if c.logprobs for x in c.logprobs.token_logprobs]
    assert tokens == gen.logprobs.tokens and lps == pytest.approx(gen.logprobs.token_logprobs)
    assert "".join(c.text for ch in chunks for c in ch.choices) == gen.text
    # vLLM's prompt_logprobs field
    r = httpx.post(
        f"{client.base_url}completions",
        json={"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60,
    ).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and [
        plp[j][str(prompt[j])]["logprob"] for j in range(1, len(prompt))
    ] == (pytest.approx(want, abs=1e-4))


def test_tokenize_and_detokenize(server: ServerProcess, tokenizer: Any) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    chat = httpx.post(
        f"{server.url}/tokenize", json={"messages": _msgs("Hi"), "return_token_strs": True}
    ).json()
    rendered = tokenizer.apply_chat_template(
        _msgs("Hi"),
        chat_template=(DATA / "hermes_tools.jinja").read_text(),
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    d = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == tokenizer.decode(r["tokens"])
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ---- lm-evaluation-harness ------------------------------------------------------------------
TASK_YAML = """
task: kvscale_tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_loglikelihood(
    server: ServerProcess, llama_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    docs = [
        {"question": "The sky is", "choices": [" blue", " green"], "answer": 0},
        {"question": "Two plus two is", "choices": [" four", " five", " six"], "answer": 0},
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "task.yaml").write_text(TASK_YAML.format(data=data))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model=tiny,base_url={server.url}/v1/completions,tokenizer={llama_ckpt},"
            "num_concurrent=2,max_retries=1,tokenized_requests=True,add_bos_token=True"
        ),
        tasks=["kvscale_tiny_ll"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
    )
    samples = results["samples"]["kvscale_tiny_ll"]
    assert len(samples) == len(docs)
    tok = AutoTokenizer.from_pretrained(str(llama_ckpt))
    model = AutoModelForCausalLM.from_pretrained(str(llama_ckpt), dtype=torch.float32)
    for s in samples:
        args = s["arguments"]
        pairs = [tuple(a.values()) for a in args.values()] if isinstance(args, dict) else args
        # resps: per choice, [(loglikelihood, is_greedy)] as lm_eval parsed the server's answer
        for resp, (context, continuation) in zip(s["resps"], pairs, strict=True):
            n = len(context) - len(context.rstrip())  # lm_eval moves trailing spaces
            context, continuation = (
                context[: len(context) - n],
                context[len(context) - n :] + (continuation),
            )
            whole = tok(context + continuation).input_ids
            ctx = tok(context).input_ids
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
            want = sum(lp[j - 1, whole[j]].item() for j in range(len(ctx), len(whole)))
            assert resp[0][0] == pytest.approx(want, abs=1e-3)
    assert 0.0 <= results["results"]["kvscale_tiny_ll"]["acc,none"] <= 1.0
