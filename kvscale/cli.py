"""Command line.

``kvscale serve``: the OpenAI-compatible HTTP server. ``kvscale route``: a prefix-aware
proxy in front of several servers. ``kvscale bench serve``: a load generator against such
a server. ``kvscale generate``: offline generation. ``kvscale serve-draft``: a draft model
for speculative decoding, served on a Unix socket.
"""

from __future__ import annotations

import argparse
import sys
import time

SERVE_EPILOG = """\
endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health (liveness), GET /ready (readiness), GET /metrics (Prometheus).
On SIGTERM the server drains: /ready and new requests answer 503, requests in flight
finish (up to --drain-timeout), then it exits 0.
"""


def _generate(args: argparse.Namespace) -> int:
    from kvscale.server import LLM, SamplingParams
    from kvscale.server.config import engine_settings

    t0 = time.perf_counter()
    print(f"loading {args.model!r} ...", file=sys.stderr)
    llm = LLM(**engine_settings(args))
    print(f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    t0 = time.perf_counter()
    outs = llm.generate(args.prompt, params)
    dt = time.perf_counter() - t0
    for out in outs:
        c = out.outputs[0]
        print(
            f"prompt: {out.prompt!r}\noutput: {c.text!r}  [{len(c.token_ids)} tokens, "
            f"finish_reason={c.finish_reason}]"
        )
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{n} tokens in {dt:.2f}s", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvscale.server.api.launcher import run_server

    return run_server(args)


def _serve_draft(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from kvscale.server.config import CheckpointError, resolve_model_path
    from kvscale.server.spec_decode.draft_runner import DraftRunner, draft_engine_config
    from kvscale.server.spec_decode.draft_sidecar import serve_draft, socket_path
    from kvscale.server.spec_decode.tokenizer_check import tokenizer_fingerprint

    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("kvscale.draft")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        model = resolve_model_path(args.model)
        engine = draft_engine_config(
            model,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks,
            seed=args.seed,
        )
        fingerprint = tokenizer_fingerprint(model)
        runner = DraftRunner.from_engine_config(
            engine,
            args.num_speculative_tokens,
            args.top_m,
            vocab_limit=args.vocab_limit,
            kv_cache_tokens=args.kv_cache_tokens,
        )
    except CheckpointError as e:
        print(f"kvscale serve-draft: cannot load the draft model: {e}", file=sys.stderr)
        return 1
    path = socket_path(args.socket)

    def ready() -> None:
        log.info(
            "draft sidecar ready on %s: %s on %s (%s), k=%d, top_m=%d, %d KV blocks, "
            "tokenizer %s",
            path, model, runner.device, str(runner.config.dtype).removeprefix("torch."),
            runner.max_k, runner.top_m, runner.block_manager.num_blocks, fingerprint[:12],
        )  # fmt: skip

    serve_draft(runner, path, fingerprint, stop=stop, on_ready=ready)
    log.info("draft sidecar stopped")
    return 0


def _add_serve_draft_arguments(p: argparse.ArgumentParser) -> None:
    from dataclasses import fields

    from kvscale.server.config import DEFAULT_BATCH, EngineConfig
    from kvscale.server.spec_decode.draft_runner import DEFAULT_TOP_M

    settings = {f.name: f for f in fields(EngineConfig)}

    def setting(name: str, kind: type, **kw: object) -> None:
        f = settings[name]  # the engine's own help text and default
        default = kw.pop("default", f.default)
        shown = "" if default is None else " (default: %(default)s)"
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=default,
            help=f.metadata["help"] + shown,
            **kw,  # type: ignore[arg-type]
        )

    p.add_argument("--model", required=True, help="draft checkpoint folder (or 'demo')")
    p.add_argument(
        "--socket", required=True, help="Unix socket to listen on: a path or unix:///path"
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=4,
        help="most tokens drafted per sequence and step (default: %(default)s)",
    )
    p.add_argument(
        "--top-m",
        type=int,
        default=DEFAULT_TOP_M,
        help="support of a sampled draft's distribution: its top M tokens, renormalised "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--vocab-limit",
        type=int,
        default=None,
        help="draft only token ids below this: the target's vocabulary size, when the draft "
        "model's is larger (default: the draft model's)",
    )
    setting("device", str)
    setting("dtype", str)
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=DEFAULT_BATCH[0],
        help="sequences per batch: the target's --max-num-seqs (default: %(default)s, the "
        "target's own default with speculative decoding)",
    )
    setting("max_model_len", int)
    setting("block_size", int)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (or:)")
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens (default: room for max-num-seqs sequences of "
        "max-model-len tokens, at most 1 GiB)",
    )
    setting("seed", int)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: %(default)s)",
    )


def _route(args: argparse.Namespace) -> int:
    from kvscale.router.cli import run

    return run(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from kvscale.bench_serve import main

    return main(args)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from kvscale.server.config import add_engine_arguments

    add_engine_arguments(p)  # --model, --dtype, --max-num-seqs, ...: one per EngineConfig setting
    g = p.add_argument_group("model serving")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is used in responses and metric "
        "labels (default: the --model value)",
    )
    g.add_argument(
        "--chat-template", default=None, help="Jinja file replacing the tokenizer's chat template"
    )
    from kvscale.server.api.tool_parsers import PARSERS

    g.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="format of the model's tool calls, read for tool_choice auto (default: the one "
        "the chat template uses, if known: <tool_call> hermes, [TOOL_CALLS] mistral, Llama 3 "
        "python_tag llama3_json)",
    )
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice auto works whenever a tool call "
        "parser is known",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    g.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default: %(default)s)"
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVSCALE_API_KEY)",
    )
    g.add_argument(
        "--prefix-cache-salt-per-key",
        action="store_true",
        help="salt each request's prefix-cache blocks with its bearer token, so that clients "
        "with different keys never share cached blocks",
    )
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="answer 429 (Retry-After) while this many sequences wait (default: no limit)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let requests in flight finish before exiting "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="answer 413 to larger request bodies (default: max(1 MiB, 64 x max-model-len); "
        "0: no limit)",
    )
    g.add_argument(
        "--max-header-bytes",
        type=int,
        default=65536,
        help="answer 431 when a request line and its headers exceed this (default: %(default)s)",
    )
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send its headers, or between two parts of its "
        "body, before 408 (default: %(default)s)",
    )
    g.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=30.0,
        help="seconds without a word from the engine process (it reports every step, and "
        "every second when idle) before /ready fails and requests in flight get an error "
        "(default: %(default)s)",
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation")
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: %(default)s)",
    )
    g.add_argument("--disable-access-log", action="store_true", help="no per-request log")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: a unique prefix of a flag must not stand for it
    # (an operator-managed flag could otherwise be set through extraArgs as "--api-k").
    parser = argparse.ArgumentParser(
        prog="kvscale",
        allow_abbrev=False,
        description="LLM serving on Kubernetes: an OpenAI-compatible inference server, a "
        "serving benchmark and offline generation.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server on a checkpoint or the demo model.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    draft = sub.add_parser(
        "serve-draft",
        allow_abbrev=False,
        help="serve a draft model for speculative decoding on a Unix socket",
        description="Serve a draft model (same tokenizer as the target) to a kvscale server "
        "over a Unix socket: one client, one round trip per step. Exits 0 on SIGTERM.",
    )
    _add_serve_draft_arguments(draft)
    draft.set_defaults(func=_serve_draft)

    from kvscale.router.cli import EPILOG as ROUTE_EPILOG
    from kvscale.router.cli import add_arguments as add_route_arguments

    route = sub.add_parser(
        "route",
        allow_abbrev=False,
        help="run the prefix-aware router in front of several servers",
        description="An OpenAI-compatible reverse proxy that sends each request to one of "
        "--upstream's ready replicas (prefix affinity with bounded loads by default).",
        epilog=ROUTE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_route_arguments(route)
    route.set_defaults(func=_route)

    bench = sub.add_parser("bench", help="benchmarks (kvscale bench serve --help)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bserve = bench_sub.add_parser(
        "serve",
        allow_abbrev=False,
        help="load-test a running server and report throughput and latency",
        description="Load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL and "
        "end-to-end latency (mean, median, p99), printed and written as JSON.",
    )
    from kvscale.bench_serve import add_arguments

    add_arguments(bserve)
    bserve.set_defaults(func=_bench_serve)

    gen = sub.add_parser(
        "generate", help="generate text offline from one or more prompts", allow_abbrev=False
    )
    from kvscale.server.config import add_engine_arguments

    add_engine_arguments(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "generate" and not args.prompt:
        args.prompt = ["The quick brown fox", "Kubernetes operators are"]
    try:
        sys.exit(args.func(args))
    except ValueError as e:
        print(f"kvscale {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
