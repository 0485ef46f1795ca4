"""``kvscale bench serve``: a load generator for an OpenAI-compatible server.

Sends ``--num-prompts`` streaming ``/v1/completions`` requests (token-id prompts, so the
input length is exact; ``ignore_eos`` so the output length is exactly as asked) at
``--request-rate`` (Poisson arrivals; ``inf`` sends all at once) with at most
``--max-concurrency`` in flight, and reports throughput and TTFT / TPOT / ITL / E2E
latency (mean, median, p99) like vLLM's ``benchmark_serving``, on stdout and as JSON.

``--tokenizer`` sends text instead: prompts made of whole-word tokens of that tokenizer,
which it encodes back to exactly the same ids (BOS first), so the input lengths stay
exact for any server that tokenizes with it. ``--backend transformers`` talks to
``transformers serve`` (text prompts only; no ``ignore_eos``: a generation config with no
EOS instead).

Datasets: ``random`` (fixed lengths, optionally spread by ``--range-ratio``),
``sharegpt-like``: input and output lengths drawn from seeded log-normal distributions
with ShareGPT's published means (about 200 input and 180 output tokens), since no
dataset can be downloaded; and two for prefix caching: ``prefix`` (``--prefix-groups``
groups, each with a shared system prompt of ``--prefix-len`` tokens followed by a
question of ``--input-len`` tokens; requests interleave the groups) and ``multi-turn``
(``--prefix-groups`` conversations of ``--turns`` turns; each turn resends the
conversation so far, its earlier answers standing in as ``--output-len`` random ids,
plus a new ``--input-len``-token message, and is sent only after the previous turn of
its conversation finished).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

SHAREGPT_MEAN_INPUT = 200  # tokens
SHAREGPT_MEAN_OUTPUT = 180  # tokens
SHAREGPT_SIGMA = 0.9  # log-normal shape: a long tail, as in real conversations
SHAREGPT_MAX_LEN = 1024  # each of input and output is clipped to [4, this]
MIN_LEN = 4
TOKEN_ID_RANGE = (100, 5000)  # prompt token ids are drawn from here (valid in any real vocab)
# Pooled connections idle longer than this are not reused: below the 5 s after which
# uvicorn-based servers (kvscale serve, vLLM, SGLang) close them. aiohttp's default (15 s)
# let a busy client send a request on a connection the server had just closed, which
# failed it ("Server disconnected").
CLIENT_KEEPALIVE_S = 4.0


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt_text: str | None = None  # sent instead of the ids when set
    after: int | None = None  # index of the request that must finish before this one starts


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between chunks
    latency: float = 0.0  # seconds, end to end
    error: str = ""
    start: float = 0.0  # seconds from the benchmark's start to the request's send


# ---- datasets -----------------------------------------------------------------------------
def _lognormal(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean before clipping
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def sample_lengths(
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    range_ratio: float = 0.0,
    max_model_len: int | None = None,
) -> list[tuple[int, int]]:
    """``(input_len, output_len)`` per request; deterministic for a seed.

    ``max_model_len`` (if known) caps each pair so that input + output fits the context.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    pairs = []
    for _ in range(num_prompts):
        if dataset == "random":
            if input_len < 1 or output_len < 1:
                raise ValueError("input_len and output_len must be >= 1")
            i = rng.randint(
                max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
            )
            o = rng.randint(
                max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
            )
        elif dataset == "sharegpt-like":
            i = _lognormal(rng, SHAREGPT_MEAN_INPUT, SHAREGPT_SIGMA, MIN_LEN, SHAREGPT_MAX_LEN)
            o = _lognormal(rng, SHAREGPT_MEAN_OUTPUT, SHAREGPT_SIGMA, MIN_LEN, SHAREGPT_MAX_LEN)
        else:
            raise ValueError(f"dataset must be 'random' or 'sharegpt-like', got {dataset!r}")
        if max_model_len is not None:
            i = min(i, max(1, max_model_len // 2))
            o = max(1, min(o, max_model_len - i))
        pairs.append((i, o))
    return pairs


def make_requests(lengths: list[tuple[int, int]], seed: int) -> list[BenchRequest]:
    """Random token-id prompts of the given lengths (seeded)."""
    rng = random.Random(seed + 1)
    lo, hi = TOKEN_ID_RANGE
    return [BenchRequest([rng.randrange(lo, hi) for _ in range(i)], o) for i, o in lengths]


def make_prefix_requests(
    num_prompts: int, groups: int, prefix_len: int, input_len: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """``num_prompts`` token-id prompts: request ``i`` is group ``i % groups``'s shared
    ``prefix_len``-token system prompt plus its own ``input_len``-token question."""
    if groups < 1 or prefix_len < 0 or input_len < 1 or output_len < 1 or num_prompts < 1:
        raise ValueError("prefix workload: groups, input_len, output_len, num_prompts >= 1")
    rng = random.Random(seed + 1)
    lo, hi = TOKEN_ID_RANGE
    prefixes = [[rng.randrange(lo, hi) for _ in range(prefix_len)] for _ in range(groups)]
    return [
        BenchRequest(
            prefixes[i % groups] + [rng.randrange(lo, hi) for _ in range(input_len)], output_len
        )
        for i in range(num_prompts)
    ]


def make_multi_turn_requests(
    conversations: int, turns: int, input_len: int, output_len: int, seed: int
) -> list[BenchRequest]:
    """``conversations * turns`` requests, turn by turn: turn ``t`` of a conversation is
    turn ``t - 1``'s prompt, an answer (``output_len`` random ids standing in for the
    reply) and a new ``input_len``-token message; it waits for turn ``t - 1``."""
    if conversations < 1 or turns < 1 or input_len < 1 or output_len < 1:
        raise ValueError("multi-turn workload: conversations, turns, lengths must be >= 1")
    rng = random.Random(seed + 1)
    lo, hi = TOKEN_ID_RANGE

    def ids(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    out: list[BenchRequest] = []
    history = [ids(input_len) for _ in range(conversations)]
    for t in range(turns):
        for c in range(conversations):
            if t:
                history[c] = history[c] + ids(output_len) + ids(input_len)
            after = (t - 1) * conversations + c if t else None
            out.append(BenchRequest(list(history[c]), output_len, after=after))
    return out


def word_pool(tokenizer_json: str) -> list[tuple[int, str]]:
    """``(id, word)`` of the tokenizer's whole-word tokens (a word boundary marker and
    two or more lowercase letters) with ids in TOKEN_ID_RANGE."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    lo, hi = TOKEN_ID_RANGE
    pool = []
    for i in range(lo, hi):
        piece = tok.id_to_token(i) or ""
        if piece[:1] in ("\u2581", "\u0120") and re.fullmatch(r"[a-z]{2,}", piece[1:]):
            pool.append((i, piece[1:]))
    if len(pool) < 100:
        raise ValueError(f"{tokenizer_json}: too few whole-word tokens ({len(pool)}) for prompts")
    return pool


def make_text_requests(
    lengths: list[tuple[int, int]], seed: int, tokenizer_json: str
) -> list[BenchRequest]:
    """Text prompts that ``tokenizer_json`` encodes to exactly ``input_len`` ids (the
    special tokens it adds, e.g. BOS, then one id per word); raises ValueError if it does
    not for some prompt."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    pool = word_pool(tokenizer_json)
    prefix = tok.encode("").ids
    rng = random.Random(seed + 1)
    out = []
    for i, o in lengths:
        words = [rng.choice(pool) for _ in range(max(1, i - len(prefix)))]
        want = prefix + [t for t, _ in words]
        # word-boundary tokens: SentencePiece marks the first word itself, byte-level
        # BPE needs the leading space written out
        for text in (" ".join(w for _, w in words), "".join(" " + w for _, w in words)):
            if tok.encode(text).ids == want:
                break
        else:
            raise ValueError(f"{tokenizer_json} does not encode the prompt words back exactly")
        out.append(BenchRequest(want, o, text))
    return out


def arrival_delays(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (Poisson), 0 when rate is inf."""
    if math.isinf(request_rate):
        return [0.0] * num
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 or inf, got {request_rate}")
    rng = random.Random(seed + 2)
    return [rng.expovariate(request_rate) for _ in range(num)]


# ---- statistics ---------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); 0 if empty."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats_ms(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "mean": sum(ms) / len(ms) if ms else 0.0,
        "median": percentile(ms, 50),
        "p99": percentile(ms, 99),
    }


def summarize(
    results: list[RequestResult], duration: float, detailed: bool = False
) -> dict[str, Any]:
    """The benchmark's numbers: counts, throughputs (per second), latencies (ms);
    ``detailed`` adds each request's lengths, send time, TTFT and inter-token latencies
    (seconds to the microsecond, in request order: vLLM's ``--save-detailed`` fields but
    its per-request errors, plus ``start_times``), from which the server's steps can be
    lined up across requests."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    d = max(duration, 1e-9)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / d,
        "input_throughput": total_in / d,
        "output_throughput": total_out / d,
        "total_token_throughput": (total_in + total_out) / d,
    }
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        for stat, v in _stats_ms(values).items():
            out[f"{stat}_{name}_ms"] = v
    errors = [r.error for r in results if not r.success and r.error]
    out["errors"] = errors[:10]
    if detailed:
        out["input_lens"] = [r.prompt_len for r in results]
        out["output_lens"] = [r.output_tokens for r in results]
        out["start_times"] = [round(r.start, 6) for r in results]
        out["ttfts"] = [round(r.ttft, 6) for r in results]
        out["itls"] = [[round(x, 6) for x in r.itl] for r in results]
    return out


def format_summary(s: dict[str, Any]) -> str:
    """A fixed-width table, in the style of vLLM's benchmark_serving."""
    w = 50

    def row(label: str, value: Any) -> str:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40}{v:>10}"

    lines = [
        " Serving Benchmark Result ".center(w, "="),
        row("Successful requests:", s["successful_requests"]),
        row("Failed requests:", s["failed_requests"]),
        row("Benchmark duration (s):", s["duration_s"]),
        row("Total input tokens:", s["total_input_tokens"]),
        row("Total generated tokens:", s["total_output_tokens"]),
        row("Request throughput (req/s):", s["request_throughput"]),
        row("Input token throughput (tok/s):", s["input_throughput"]),
        row("Output token throughput (tok/s):", s["output_throughput"]),
        row("Total token throughput (tok/s):", s["total_token_throughput"]),
    ]
    for key, title, short in (
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
        ("e2el", "End-to-end Latency", "E2EL"),
    ):
        lines.append(f" {title} ".center(w, "-"))
        lines.append(row(f"Mean {short} (ms):", s[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", s[f"median_{key}_ms"]))
        lines.append(row(f"P99 {short} (ms):", s[f"p99_{key}_ms"]))
    lines.append("=" * w)
    return "\n".join(lines)


# ---- the load generator -------------------------------------------------------------------
def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of a server-sent event stream from raw body chunks. Only CR and LF end a line
    there (readers that split like str.splitlines also break on U+2028 and friends, which
    a token's text may hold unescaped); no line-length limit."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", errors="replace")


def request_body(model: str, req: BenchRequest, backend: str) -> dict[str, Any]:
    """The JSON body of one streaming completion for ``backend``."""
    prompt: Any = req.prompt_text if req.prompt_text is not None else req.prompt_token_ids
    if backend == "transformers":
        if req.prompt_text is None:
            raise ValueError("--backend transformers takes text prompts: pass --tokenizer")
        gen = {"do_sample": False, "max_new_tokens": req.output_len, "eos_token_id": -1}
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "stream": True,
            "generation_config": json.dumps(gen),
        }
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def client_session(max_connections: int, timeout_s: float) -> Any:
    """The HTTP client for ``send_request``: an aiohttp session, whose C HTTP parser keeps
    the client from becoming the bottleneck (and from batching chunks) at hundreds of
    streams, as in vLLM's benchmark client. Use it as an async context manager."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=CLIENT_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10.0),
    )


async def send_request(
    client: Any,
    base_url: str,
    model: str,
    req: BenchRequest,
    api_key: str | None,
    backend: str = "kvscale",
) -> RequestResult:
    """One streaming completion through ``client`` (``client_session``); times the chunks
    as they arrive."""
    body = request_body(model, req, backend)
    res = RequestResult(prompt_len=len(req.prompt_token_ids))
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.post(
            f"{base_url}/v1/completions", json=body, headers=_headers(api_key)
        ) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read()).decode()[:200]}"
                return res
            async for line in sse_lines(resp.content.iter_any()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    res.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return res
                now = time.perf_counter()
                if any(c.get("text") for c in obj.get("choices") or ()):
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens", 0))
                    res.prompt_len = int(usage.get("prompt_tokens", res.prompt_len))
        res.latency = time.perf_counter() - start
        if not res.output_tokens:
            res.output_tokens = chunks
        res.success = chunks > 0
        if not res.success:
            res.error = "the stream ended without any chunk"
    except Exception as e:  # a failed request is counted, never fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _server_model(
    client: Any, base_url: str, api_key: str | None, model: str | None
) -> tuple[str, int | None]:
    """The model name and context length from ``/v1/models``; with ``model`` given, a
    server whose listing fails is still benchmarked (context length unknown)."""
    try:
        async with client.get(f"{base_url}/v1/models", headers=_headers(api_key)) as resp:
            resp.raise_for_status()
            card = (await resp.json())["data"][0]
    except Exception:
        if model is None:
            raise
        return model, None
    return model or card["id"], card.get("max_model_len")


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the load and returns ``summarize``'s dict plus the configuration."""
    from tqdm import tqdm

    base_url = args.base_url.rstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    conc = args.max_concurrency or args.num_prompts
    async with client_session(conc, args.timeout) as client:
        model, max_model_len = await _server_model(client, base_url, api_key, args.model)
        requests = build_requests(args, max_model_len)
        delays = arrival_delays(len(requests), args.request_rate, args.seed)
        sem = asyncio.Semaphore(conc)
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, file=sys.stderr, unit="req")
        done = [asyncio.Event() for _ in requests]

        async def one(i: int, req: BenchRequest) -> RequestResult:
            if req.after is not None:
                await done[req.after].wait()
            try:
                async with sem:
                    sent = time.perf_counter() - t0
                    res = await send_request(client, base_url, model, req, api_key, args.backend)
                    res.start = sent
                    return res
            finally:
                done[i].set()
                bar.update(1)

        tasks = []
        t0 = time.perf_counter()
        for i, (req, delay) in enumerate(zip(requests, delays, strict=True)):
            if delay:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    summary = summarize(list(results), duration, args.save_detailed)
    summary["config"] = {
        "base_url": base_url,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "prefix_groups": args.prefix_groups,
        "prefix_len": args.prefix_len,
        "turns": args.turns,
        "seed": args.seed,
        "backend": args.backend,
        "prompts": "text" if args.tokenizer else "token ids",
    }
    return summary


def build_requests(args: argparse.Namespace, max_model_len: int | None) -> list[BenchRequest]:
    """The requests of ``args.dataset``."""
    if args.dataset == "prefix":
        return make_prefix_requests(
            args.num_prompts, args.prefix_groups, args.prefix_len, args.input_len,
            args.output_len, args.seed,
        )  # fmt: skip
    if args.dataset == "multi-turn":
        return make_multi_turn_requests(
            args.prefix_groups, args.turns, args.input_len, args.output_len, args.seed
        )
    lengths = sample_lengths(
        args.dataset,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.seed,
        args.range_ratio,
        max_model_len,
    )
    if args.tokenizer:
        return make_text_requests(lengths, args.seed, _tokenizer_json(args.tokenizer))
    return make_requests(lengths, args.seed)


def _tokenizer_json(path: str) -> str:
    """``path`` itself, or the tokenizer.json inside a checkpoint folder."""
    return os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = " (default: %(default)s)"
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load" + d)
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument(
        "--dataset",
        choices=["random", "sharegpt-like", "prefix", "multi-turn"],
        default="random",
        help="random: --input-len/--output-len; sharegpt-like: seeded lengths with "
        "ShareGPT's means (~200 in, ~180 out); prefix: --prefix-groups shared system "
        "prompts of --prefix-len tokens, each request one plus an --input-len question; "
        "multi-turn: --prefix-groups conversations of --turns turns, each resending the "
        "conversation so far" + d,
    )
    p.add_argument("--prefix-groups", type=int, default=8, help="prefix/multi-turn: groups" + d)
    p.add_argument(
        "--prefix-len", type=int, default=512, help="prefix: shared system-prompt tokens" + d
    )
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation" + d)
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send" + d)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (Poisson arrivals); inf sends all at once" + d,
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: all)"
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens, random dataset" + d)
    p.add_argument("--output-len", type=int, default=128, help="output tokens, random dataset" + d)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random dataset: lengths uniform in len*(1 -/+ ratio)" + d,
    )
    p.add_argument("--seed", type=int, default=0, help="seed for lengths, prompts, arrivals" + d)
    p.add_argument(
        "--result-file", default="bench-serve-result.json", help="results as JSON go here" + d
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, s" + d)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json (or a checkpoint folder): send text prompts that it encodes "
        "to exactly the sampled lengths (default: token-id prompts)",
    )
    p.add_argument(
        "--backend",
        choices=["kvscale", "transformers"],
        default="kvscale",
        help="kvscale (or any vLLM-compatible server) | transformers (transformers serve; "
        "needs --tokenizer)" + d,
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="also write each request's prompt and output lengths, send time, TTFT and "
        "inter-token latencies (s) to the result file",
    )


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark, prints the table, writes the JSON; 1 if every request failed."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    summary = asyncio.run(run_benchmark(args))
    print(format_summary(summary))
    for err in summary["errors"][:3]:
        print(f"error: {err}", file=sys.stderr)
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            # one line when detailed: the lists hold a number per token
            json.dump(summary, f, indent=None if args.save_detailed else 2)
        print(f"results written to {args.result_file}", file=sys.stderr)
    return 0 if summary["successful_requests"] else 1


__all__ = [
    "BenchRequest",
    "RequestResult",
    "add_arguments",
    "arrival_delays",
    "client_session",
    "format_summary",
    "main",
    "make_requests",
    "make_text_requests",
    "percentile",
    "request_body",
    "sample_lengths",
    "sse_lines",
    "summarize",
]
