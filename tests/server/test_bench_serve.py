"""The pure parts of ``kvscale bench serve``: lengths, arrivals, percentiles, the summary."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from pathlib import Path

import pytest

from kvscale.bench_serve import (
    RequestResult,
    arrival_delays,
    format_summary,
    make_multi_turn_requests,
    make_prefix_requests,
    make_requests,
    make_text_requests,
    percentile,
    request_body,
    sample_lengths,
    sse_lines,
    summarize,
)


def test_random_dataset_lengths() -> None:
    assert sample_lengths("random", 5, 32, 8, seed=0) == [(32, 8)] * 5
    spread = sample_lengths("random", 500, 100, 50, seed=0, range_ratio=0.5)
    assert all(50 <= i <= 150 and 25 <= o <= 75 for i, o in spread)
    assert len({i for i, _ in spread}) > 20


def test_sharegpt_like_is_seeded_with_sharegpt_means() -> None:
    a = sample_lengths("sharegpt-like", 4000, 0, 0, seed=3)
    assert a == sample_lengths("sharegpt-like", 4000, 0, 0, seed=3)
    assert a != sample_lengths("sharegpt-like", 4000, 0, 0, seed=4)
    ins, outs = [i for i, _ in a], [o for _, o in a]
    assert statistics.mean(ins) == pytest.approx(200, rel=0.08)
    assert statistics.mean(outs) == pytest.approx(180, rel=0.08)
    assert min(ins) >= 4 and max(ins) <= 1024
    assert statistics.median(ins) < statistics.mean(ins)  # long-tailed, like real chats


def test_lengths_fit_the_context() -> None:
    for i, o in sample_lengths("sharegpt-like", 300, 0, 0, seed=1, max_model_len=256):
        assert i + o <= 256 and i >= 1 and o >= 1


def test_bad_dataset_arguments() -> None:
    with pytest.raises(ValueError, match="dataset"):
        sample_lengths("alpaca", 1, 1, 1, seed=0)
    with pytest.raises(ValueError, match="num_prompts"):
        sample_lengths("random", 0, 1, 1, seed=0)
    with pytest.raises(ValueError, match="request_rate"):
        arrival_delays(3, 0.0, seed=0)


def test_prompts_have_the_exact_lengths() -> None:
    reqs = make_requests([(3, 7), (10, 1)], seed=0)
    assert [len(r.prompt_token_ids) for r in reqs] == [3, 10]
    assert [r.output_len for r in reqs] == [7, 1]
    assert reqs[0].prompt_token_ids == make_requests([(3, 7)], seed=0)[0].prompt_token_ids


def test_arrivals_are_poisson_or_all_at_once() -> None:
    assert arrival_delays(4, math.inf, seed=0) == [0.0] * 4
    gaps = arrival_delays(5000, 10.0, seed=0)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.05)


def test_percentile_interpolates_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([], 50) == 0.0


def test_summary_math_and_table() -> None:
    results = [
        RequestResult(True, 10, 5, ttft=0.1, itl=[0.02] * 4, latency=0.18),
        RequestResult(True, 20, 3, ttft=0.3, itl=[0.05, 0.05], latency=0.4),
        RequestResult(False, 30, 0, error="HTTP 429: full"),
    ]
    s = summarize(results, duration=2.0)
    assert s["successful_requests"] == 2 and s["failed_requests"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 4.0 and s["total_token_throughput"] == 19.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx((20.0 + 50.0) / 2)  # (e2e - ttft) / (out - 1)
    assert s["mean_itl_ms"] == pytest.approx((4 * 20 + 2 * 50) / 6)
    assert s["p99_e2el_ms"] == pytest.approx(180 + 0.99 * 220)
    assert s["errors"] == ["HTTP 429: full"]
    table = format_summary(s)
    for label in (
        "Successful requests:", "Failed requests:", "Benchmark duration (s):",
        "Request throughput (req/s):", "Input token throughput (tok/s):",
        "Output token throughput (tok/s):", "Total token throughput (tok/s):",
        "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "P99 E2EL (ms):",
    ):  # fmt: skip
        assert label in table, label


def test_detailed_summary_keeps_each_request_in_order() -> None:
    results = [
        RequestResult(True, 10, 3, ttft=0.1, itl=[0.02, 0.03], latency=0.15, start=0.0),
        RequestResult(False, 30, 0, error="HTTP 429: full", start=0.5),
        RequestResult(True, 20, 2, ttft=0.3, itl=[0.05], latency=0.35, start=0.25),
    ]
    plain = summarize(results, duration=1.0)
    s = summarize(results, duration=1.0, detailed=True)
    assert {k: v for k, v in s.items() if k in plain} == plain
    assert "itls" not in plain and "start_times" not in plain
    assert s["input_lens"] == [10, 30, 20] and s["output_lens"] == [3, 0, 2]
    assert s["start_times"] == [0.0, 0.5, 0.25]
    assert s["ttfts"] == [0.1, 0.0, 0.3]
    assert s["itls"] == [[0.02, 0.03], [], [0.05]]
    assert s["errors"] == ["HTTP 429: full"]


@pytest.mark.parametrize("kind", ["sentencepiece", "tekken"])
def test_text_prompts_encode_back_to_exact_lengths(kind: str, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from kvscale.server.demo_model import write_tokenizer

    write_tokenizer(tmp_path, kind)
    path = str(tmp_path / "tokenizer.json")
    lengths = sample_lengths("sharegpt-like", 40, 0, 0, seed=5)
    reqs = make_text_requests(lengths, seed=5, tokenizer_json=path)
    tok = Tokenizer.from_file(path)
    for (i, o), r in zip(lengths, reqs, strict=True):
        assert r.prompt_text is not None and r.output_len == o
        assert tok.encode(r.prompt_text).ids == r.prompt_token_ids and len(r.prompt_token_ids) == i
        assert r.prompt_token_ids[0] == 1  # BOS


def test_request_bodies_per_backend() -> None:
    req = make_requests([(4, 9)], seed=0)[0]
    ours = request_body("m", req, "kvscale")
    assert ours["prompt"] == req.prompt_token_ids and ours["ignore_eos"] is True
    assert ours["max_tokens"] == 9 and ours["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="text prompts"):
        request_body("m", req, "transformers")
    req.prompt_text = "hello there"
    peer = request_body("m", req, "transformers")
    assert peer["prompt"] == "hello there" and "ignore_eos" not in peer
    gen = json.loads(peer["generation_config"])
    assert gen == {"do_sample": False, "max_new_tokens": 9, "eos_token_id": -1}


def test_sse_lines_break_only_at_newlines() -> None:
    import asyncio

    async def chunks():  # type: ignore[no-untyped-def]
        for c in ['data: {"t":"a\u2028b"}\r', "\n\ndata: [DO", "NE]\n\n"]:
            yield c.encode()

    async def collect() -> list[str]:
        return [line async for line in sse_lines(chunks())]

    lines = asyncio.run(collect())
    assert lines == ['data: {"t":"a\u2028b"}', "", "data: [DONE]", ""]


def test_prefix_workload_interleaves_groups_sharing_their_system_prompt() -> None:
    reqs = make_prefix_requests(10, groups=3, prefix_len=20, input_len=5, output_len=4, seed=0)
    assert len(reqs) == 10 and all(len(r.prompt_token_ids) == 25 for r in reqs)
    prefix = [r.prompt_token_ids[:20] for r in reqs]
    assert prefix[0] == prefix[3] == prefix[6] == prefix[9] != prefix[1]
    assert prefix[1] == prefix[4] != prefix[2]
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 10  # questions differ
    assert reqs == make_prefix_requests(10, 3, 20, 5, 4, seed=0)  # seeded


def test_multi_turn_workload_resends_the_conversation_after_the_last_turn() -> None:
    reqs = make_multi_turn_requests(conversations=2, turns=3, input_len=5, output_len=4, seed=0)
    assert len(reqs) == 6
    for t in range(3):
        for c in range(2):
            r = reqs[t * 2 + c]
            assert len(r.prompt_token_ids) == 5 + t * 9
            if t:
                prev = reqs[r.after]  # type: ignore[index]
                assert r.after == (t - 1) * 2 + c
                assert r.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            else:
                assert r.after is None
    with pytest.raises(ValueError):
        make_multi_turn_requests(0, 3, 5, 4, seed=0)


def test_the_client_drops_idle_connections_before_the_server_closes_them() -> None:
    """A busy client (its event loop blocked while the server's keep-alive ran out) must
    not send its next request on the connection the server closed: the benchmark client's
    pool expires idle connections first. aiohttp's default pool, the control, fails it
    (a POST, which aiohttp does not retry)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import aiohttp
    import uvicorn

    from kvscale.bench_serve import client_session
    from kvscale.server.api.launcher import KEEP_ALIVE_S

    async def app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, timeout_keep_alive=KEEP_ALIVE_S, log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}/"

        def idle_then_post(ours: bool) -> str:
            """A request, an idle spell that the server's keep-alive ends while the
            client's loop is busy, then a request on the pool: its outcome."""

            async def main() -> str:
                async with (
                    client_session(4, 30.0)
                    if ours
                    else aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4))
                ) as s:
                    async with s.post(url, data=b"{}") as r:
                        assert await r.read() == b"ok"
                    await asyncio.sleep(KEEP_ALIVE_S - 0.5)
                    time.sleep(1.0)  # busy: no loop pass sees the server's close
                    try:
                        async with s.post(url, data=b"{}") as r:
                            return (await r.read()).decode()
                    except aiohttp.ClientError as e:
                        return type(e).__name__

            return asyncio.run(main())

        with ThreadPoolExecutor(2) as pool:  # side by side: one idle spell for both
            outcomes = list(pool.map(idle_then_post, (True, False)))
        assert outcomes == ["ok", "ServerDisconnectedError"]
    finally:
        server.should_exit = True
        thread.join(10)
