"""The OpenAI-compatible API, driven by the ``openai`` client against a real server process."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvscale.bench_serve import sample_lengths

from .conftest import ServerProcess, metric

KEY = "test-key"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(llama_ckpt: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(llama_ckpt, "--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(server: ServerProcess, path: str, body: Any, key: str | None = KEY, **kw: Any):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, str | bytes):
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{server.url}{path}", content=body, headers=headers, timeout=60, **kw)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60, **kw)


def _wait_idle(server: ServerProcess, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        busy = metric(m, "kvscale:num_requests_running") + metric(m, "kvscale:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# ---- basics ----------------------------------------------------------------------------------
def test_health_ready_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert "kvscale:" in httpx.get(f"{server.url}/metrics").text  # no key needed


# ---- streamed == non-streamed ------------------------------------------------------------------
def _collect_completion_stream(stream: Any) -> tuple[dict, dict, dict, dict, Any]:
    text: dict[int, str] = defaultdict(str)
    tokens: dict[int, list[str]] = defaultdict(list)
    lps: dict[int, list[float]] = defaultdict(list)
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.text
            if c.logprobs is not None:
                tokens[c.index] += c.logprobs.tokens
                lps[c.index] += c.logprobs.token_logprobs
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return text, tokens, lps, finish, usage


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=24,
        temperature=0.9,
        top_p=0.95,
        seed=7,
        n=2,
        logprobs=2,
    )
    full = client.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].text != full.choices[1].text  # child seeds differ
    text, tokens, lps, finish, usage = _collect_completion_stream(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    for c in full.choices:
        assert text[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens
        assert lps[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)
        assert finish[c.index] == c.finish_reason == "length"
        assert len(c.logprobs.top_logprobs[0]) >= 2  # top 2 (+ the sampled token)
        assert c.logprobs.text_offset[0] == 0
        # each token's string sits in the text at its offset (up to the first byte of a
        # character, whose string alone is U+FFFD)
        toks, offsets = c.logprobs.tokens, c.logprobs.text_offset
        upto = next((i for i, t in enumerate(toks) if "\ufffd" in t), len(toks))
        assert upto >= 5, toks
        for tok, at in zip(toks[:upto], offsets[:upto], strict=True):
            assert c.text[at : at + len(tok)] == tok, (tok, at, c.text)
    assert usage.model_dump() == full.usage.model_dump()
    assert full.usage.completion_tokens == 48


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="tiny",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
        ],
        max_completion_tokens=20,
        temperature=0.8,
        seed=3,
        n=2,
        logprobs=True,
        top_logprobs=3,
    )
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion"
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    content: dict[int, str] = defaultdict(str)
    roles: dict[int, str] = {}
    lp_tokens: dict[int, list[str]] = defaultdict(list)
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            content[c.index] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                lp_tokens[c.index] += [t.token for t in c.logprobs.content]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in full.choices:
        assert c.message.role == "assistant" and roles[c.index] == "assistant"
        assert content[c.index] == c.message.content
        assert lp_tokens[c.index] == [t.token for t in c.logprobs.content]
        assert finish[c.index] == c.finish_reason
        first = c.logprobs.content[0]
        assert len(first.top_logprobs) == 3 and first.bytes == list(first.token.encode())
        assert first.top_logprobs[0].logprob >= first.top_logprobs[1].logprob
    assert usage is not None and usage.total_tokens == full.usage.total_tokens
    assert full.usage.prompt_tokens > 5


def test_stop_string_is_never_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=40)
    base = client.completions.create(**kw).choices[0].text
    stop = base[12:15]
    assert len(stop) == 3
    expected = base[: base.find(stop)]
    full = client.completions.create(**kw, stop=[stop, "never-there"])
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].model_extra["stop_reason"] == stop
    streamed = ""
    for chunk in client.completions.create(**kw, stop=[stop, "never-there"], stream=True):
        for c in chunk.choices:
            streamed += c.text
            assert stop not in streamed
    assert streamed == expected
    chat = (
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=30
        )
        .choices[0]
        .message.content
    )
    cut = chat[8:10]
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=30,
        stop=cut,
        stream=True,
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in got if c.choices)
        == chat[: chat.find(cut)]
    )


def test_prompt_forms_echo_and_vllm_extras(client: openai.OpenAI) -> None:
    res = client.completions.create(
        model="tiny", prompt=[[1, 415, 2936], [1, 22557]], n=2, max_tokens=3, temperature=0
    )
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert res.usage.prompt_tokens == 5 and res.usage.completion_tokens == 12
    assert res.choices[0].text == res.choices[1].text  # greedy: n copies agree
    res = client.completions.create(
        model="tiny", prompt=["Hello world", "Good morning"], echo=True, max_tokens=2
    )
    assert res.choices[0].text.startswith("Hello world")
    assert res.choices[1].text.startswith("Good morning")
    res = client.completions.create(
        model="tiny",
        prompt="Kubernetes",
        max_tokens=40,
        extra_body=dict(
            ignore_eos=True, top_k=5, min_p=0.05, repetition_penalty=1.2, min_tokens=10
        ),
        frequency_penalty=0.5,
        presence_penalty=0.5,
    )
    assert res.usage.completion_tokens == 40 and res.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 7


# ---- concurrency -------------------------------------------------------------------------------
def test_64_concurrent_streams(server: ServerProcess) -> None:
    async def run() -> list[dict[str, Any]]:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300
        )

        async def one(i: int) -> dict[str, Any]:
            prompt = [1] + [100 + 7 * i + j for j in range(2 + i % 7)]
            want = 16 + i % 9
            stream = await aclient.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=want,
                temperature=0.7,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            first = None
            text, usage, finish = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    first = first or time.monotonic()
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            return dict(
                prompt=len(prompt), want=want, usage=usage, finish=finish, text=text,
                first=first, done=time.monotonic(),
            )  # fmt: skip

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    for r in results:
        assert r["usage"].prompt_tokens == r["prompt"]
        assert r["usage"].completion_tokens == r["want"]
        assert r["usage"].total_tokens == r["prompt"] + r["want"]
        assert r["finish"] == "length" and r["text"]
    # the streams interleave: many were producing tokens at the same time
    overlap = max(sum(1 for o in results if o["first"] <= r["first"] < o["done"]) for r in results)
    assert overlap >= 8
    m = _wait_idle(server)
    assert metric(m, "kvscale:num_requests_running") == 0


# ---- errors --------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
ERROR_CASES: list[tuple[str, Any, int, str | None]] = [
    (COMP, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    (COMP, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    (COMP, {"prompt": "hi", "n": 0}, 400, "n"),
    (COMP, {"prompt": "hi", "n": 129}, 400, "n"),
    (COMP, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (COMP, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    (COMP, {"prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (COMP, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    (COMP, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (COMP, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (COMP, {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens"),
    (COMP, {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (COMP, {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (COMP, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    (COMP, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (COMP, {"max_tokens": 3}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": [5, 40000]}, 400, "prompt"),
    (COMP, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (COMP, {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    (COMP, '{"prompt": "hi",', 400, None),
    (COMP, "[1, 2]", 400, None),
    (COMP, "", 400, None),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.0.content.0",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages.0.content.0.text",
    ),
    (CHAT, {"messages": MSG, "model": "other"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),  # a request model the handler builds
    (COMP, '{"prompt": "hi \\ud800"}', 400, "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "x\\ud800"}]}', 400, "messages"),
]


def test_errors_say_what_was_wrong(server: ServerProcess) -> None:
    def message(r: httpx.Response) -> str:
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert "unpaired UTF-16 surrogate" in message(_post(server, COMP, '{"prompt": "hi \\ud800"}'))
    tokenize = message(_post(server, "/tokenize", {"messages": []}))
    assert tokenize.startswith("messages: List should have at least 1 item"), tokenize
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}
    plain = httpx.post(f"{server.url}{COMP}", content=b'{"prompt": "hi"}', headers=headers)
    assert "Content-Type: application/json, got Content-Type 'text/plain'" in message(plain)
    assert message(_post(server, COMP, "[1, 2]")) == "the request body must be a JSON object"


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES)
def test_errors_have_openai_shape(
    server: ServerProcess, path: str, body: Any, status: int, param: str | None
) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error")
    assert err["param"] == param, err


def test_context_length_errors_name_both_numbers(server: ServerProcess) -> None:
    r = _post(server, COMP, {"prompt": [1, 2, 3, 4], "max_tokens": 1000})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    for number in ("256", "1004", "4 in the prompt", "1000 in the completion"):
        assert number in err["message"], err["message"]
    r = _post(server, COMP, {"prompt": list(range(1, 301)), "max_tokens": 1})
    err = r.json()["error"]
    assert r.status_code == 400 and "300" in err["message"] and "256" in err["message"]
    r = _post(server, CHAT, {"messages": MSG, "max_tokens": 500})
    assert r.status_code == 400 and "500 in the completion" in r.json()["error"]["message"]


def test_api_key_required(server: ServerProcess, client: openai.OpenAI) -> None:
    for key in (None, "wrong"):
        r = _post(server, COMP, {"prompt": "hi"}, key=key)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server.url}/v1/models")
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", temperature=-3)
    assert "temperature" in str(e.value)
    assert (
        httpx.get(f"{server.url}/v1/nope", headers={"Authorization": f"Bearer {KEY}"}).json()[
            "error"
        ]["code"]
        == "not_found"
    )


# ---- metrics -------------------------------------------------------------------------------------
EXPECTED_METRICS = [
    "kvscale:num_requests_running",
    "kvscale:num_requests_waiting",
    "kvscale:kv_cache_usage_perc",
    "kvscale:kv_cache_blocks_total",
    "kvscale:kv_cache_blocks_free",
    "kvscale:prompt_tokens_total",
    "kvscale:generation_tokens_total",
    "kvscale:num_preemptions_total",
    "kvscale:prefix_cache_queries_total",
    "kvscale:prefix_cache_hits_total",
    "kvscale:time_to_first_token_seconds_count",
    "kvscale:inter_token_latency_seconds_count",
    "kvscale:e2e_request_latency_seconds_count",
    "kvscale:request_queue_time_seconds_count",
    "kvscale:request_prompt_tokens_count",
    "kvscale:request_generation_tokens_count",
]


def test_metrics_parse_and_counters_move(server: ServerProcess, client: openai.OpenAI) -> None:
    before = _wait_idle(server)
    for name in EXPECTED_METRICS:
        assert f"{name}{{model_name=tiny}}" in before, name
    total = metric(before, "kvscale:kv_cache_blocks_total")
    assert total > 0 and metric(before, "kvscale:kv_cache_blocks_free") == total
    assert metric(before, "kvscale:kv_cache_usage_perc") == 0.0
    res = client.completions.create(
        model="tiny", prompt=[1, 2, 3, 4], max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert res.usage.completion_tokens == 5
    after = _wait_idle(server)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("kvscale:prompt_tokens_total") == 4
    assert delta("kvscale:generation_tokens_total") == 5
    assert delta("kvscale:request_success_total", finished_reason="length") == 1
    assert delta("kvscale:time_to_first_token_seconds_count") == 1
    assert delta("kvscale:inter_token_latency_seconds_count") == 4
    assert delta("kvscale:e2e_request_latency_seconds_count") == 1
    assert delta("kvscale:request_queue_time_seconds_count") == 1
    assert delta("kvscale:request_prompt_tokens_sum") == 4
    assert delta("kvscale:request_generation_tokens_sum") == 5
    assert delta("kvscale:prefix_cache_hits_total") == 0
    assert metric(after, "kvscale:time_to_first_token_seconds_sum") > 0
    inf = metric(after, "kvscale:time_to_first_token_seconds_bucket", le="+Inf")
    assert inf == metric(after, "kvscale:time_to_first_token_seconds_count")


# ---- the benchmark client ----------------------------------------------------------------------
def test_bench_serve_against_the_server(server: ServerProcess, tmp_path: Path) -> None:
    from kvscale.cli import build_parser

    out = tmp_path / "bench.json"
    argv = [
        "bench", "serve", "--base-url", server.url, "--api-key", KEY,
        "--num-prompts", "8", "--input-len", "8", "--output-len", "6",
        "--max-concurrency", "4", "--request-rate", "inf", "--seed", "1",
        "--result-file", str(out), "--disable-tqdm", "--save-detailed",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert res["successful_requests"] == 8 and res["failed_requests"] == 0
    assert res["total_input_tokens"] == 64 and res["total_output_tokens"] == 48
    assert res["mean_ttft_ms"] > 0 and res["p99_e2el_ms"] >= res["median_e2el_ms"] > 0
    assert res["mean_tpot_ms"] > 0 and res["output_throughput"] > 0
    assert res["config"]["model"] == "tiny"
    # --save-detailed: each request's own numbers, which the summary's are made of
    assert res["input_lens"] == [8] * 8 and res["output_lens"] == [6] * 8
    assert all(0 <= t < res["duration_s"] for t in res["start_times"])
    assert sorted(res["start_times"])[4] > 0  # the fifth waited for a slot of four
    assert all(0 < len(x) <= 5 for x in res["itls"])
    itls = [x for r in res["itls"] for x in r]
    # saved to the microsecond
    assert 1e3 * sum(itls) / len(itls) == pytest.approx(res["mean_itl_ms"], abs=1e-3)
    assert 1e3 * sum(res["ttfts"]) / 8 == pytest.approx(res["mean_ttft_ms"], abs=1e-3)


def test_bench_serve_text_prompts_keep_exact_lengths(
    server: ServerProcess, llama_ckpt: Path, tmp_path: Path
) -> None:
    from kvscale.cli import build_parser

    out = tmp_path / "bench-text.json"
    argv = [
        "bench", "serve", "--base-url", server.url, "--api-key", KEY,
        "--num-prompts", "6", "--dataset", "sharegpt-like", "--tokenizer", str(llama_ckpt),
        "--max-concurrency", "3", "--seed", "2", "--result-file", str(out), "--disable-tqdm",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    lengths = sample_lengths("sharegpt-like", 6, 0, 0, seed=2, max_model_len=MAX_MODEL_LEN)
    assert res["failed_requests"] == 0 and res["config"]["prompts"] == "text"
    assert res["total_input_tokens"] == sum(i for i, _ in lengths)  # counted by the server
    assert res["total_output_tokens"] == sum(o for _, o in lengths)


def _idle_metrics(server: ServerProcess) -> dict[str, float]:
    """``/metrics`` once no sequence runs (bounded wait)."""
    for _ in range(100):
        m = server.metrics()
        if metric(m, "kvscale:num_requests_running") == 0:
            return m
        time.sleep(0.05)
    raise AssertionError("requests still running")


def test_prefix_cache_hits_move_the_metrics_and_salts_isolate(server: ServerProcess) -> None:
    assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=10).status_code == 401
    r = httpx.post(
        f"{server.url}/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 can be reused

    def run(salt: str | None) -> tuple[float, float]:
        before = _idle_metrics(server)
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        assert _post(server, COMP, body).status_code == 200
        after = _idle_metrics(server)
        q = metric(after, "kvscale:prefix_cache_queries_total") - metric(
            before, "kvscale:prefix_cache_queries_total"
        )
        h = metric(after, "kvscale:prefix_cache_hits_total") - metric(
            before, "kvscale:prefix_cache_hits_total"
        )
        return q, h

    assert run(None) == (40, 0)
    assert run(None) == (40, 32)
    assert run("tenant-b") == (40, 0)  # another salt: nothing shared
    assert run("tenant-b") == (40, 32)
    m = _idle_metrics(server)
    # cached blocks stay cached but count as free: the autoscaler sees an idle server
    assert metric(m, "kvscale:kv_cache_usage_perc") == 0.0
    assert metric(m, "kvscale:kv_cache_blocks_free") == metric(m, "kvscale:kv_cache_blocks_total")


@pytest.mark.parametrize(
    ("dataset", "extra", "count"),
    [
        ("prefix", ["--num-prompts", "6", "--prefix-groups", "2", "--prefix-len", "40"], 6),
        ("multi-turn", ["--prefix-groups", "2", "--turns", "3"], 6),
    ],
)
def test_bench_serve_prefix_workloads_hit_the_cache(
    server: ServerProcess, tmp_path: Path, dataset: str, extra: list[str], count: int
) -> None:
    from kvscale.cli import build_parser

    before = _idle_metrics(server)
    out = tmp_path / f"bench-{dataset}.json"
    argv = [
        "bench", "serve", "--base-url", server.url, "--api-key", KEY, "--dataset", dataset,
        "--input-len", "20", "--output-len", "4", "--max-concurrency", "2", "--seed", "3",
        "--result-file", str(out), "--disable-tqdm", *extra,
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    res = json.loads(out.read_text())
    assert res["successful_requests"] == count and res["failed_requests"] == 0
    hits = metric(_idle_metrics(server), "kvscale:prefix_cache_hits_total")
    assert hits > metric(before, "kvscale:prefix_cache_hits_total")
