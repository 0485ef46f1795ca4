"""Command line.

``kvscale serve``: the OpenAI-compatible HTTP server. ``kvscale bench serve``: a load
generator against such a server. ``kvscale generate``: offline generation.
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

    t0 = time.perf_counter()
    print(f"loading {args.model!r} ...", file=sys.stderr)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, seed=args.seed)
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


def _bench_serve(args: argparse.Namespace) -> int:
    from kvscale.bench_serve import main

    return main(args)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model", default="demo", help="checkpoint folder, or 'demo' (built-in; default)"
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is used in responses and metric "
        "labels (default: the --model value)",
    )
    g.add_argument("--dtype", default="auto", help="auto (default) | float32 | float16 | bfloat16")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens (default: the model's)",
    )
    g.add_argument(
        "--chat-template", default=None, help="Jinja file replacing the tokenizer's chat template"
    )
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto (default) | cpu | cuda | cuda:N")
    g.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences per batch (default: %(default)s)"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="new tokens per step (default: max(8192, max-num-seqs))",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV-cache block (default: %(default)s)",
    )
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV-cache blocks (default: from --gpu-memory-utilization; 1 GiB on CPU)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and KV cache (default: %(default)s)",
    )
    g.add_argument("--attention-backend", default="auto", help="auto (default) | torch | triton")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly instead of replaying CUDA graphs (GPU only)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the layers around attention (Inductor); slower start-up",
    )
    g.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=256,
        help="largest decode batch captured as a CUDA graph; 0 = none (default: %(default)s)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="seed of unseeded sampling (default: %(default)s)"
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
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation")
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: %(default)s)",
    )
    g.add_argument("--disable-access-log", action="store_true", help="no per-request log")
    g = p.add_argument_group("not supported yet (rejected at start)")
    g.add_argument("--enable-prefix-caching", action="store_true", help="prefix caching")
    g.add_argument("--quantization", default=None, help="weight quantization (only none)")
    g.add_argument("--speculative-model", default=None, help="draft model")
    g.add_argument("--num-speculative-tokens", type=int, default=None, help="draft tokens")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="only 1")
    g.add_argument("--kv-cache-dtype", default="auto", help="only auto")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvscale",
        description="LLM serving on Kubernetes: an OpenAI-compatible inference server, a "
        "serving benchmark and offline generation.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server on a checkpoint or the demo model.",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks (kvscale bench serve --help)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bserve = bench_sub.add_parser(
        "serve",
        help="load-test a running server and report throughput and latency",
        description="Load-test an OpenAI-compatible server: throughput, TTFT, TPOT, ITL and "
        "end-to-end latency (mean, median, p99), printed and written as JSON.",
    )
    from kvscale.bench_serve import add_arguments

    add_arguments(bserve)
    bserve.set_defaults(func=_bench_serve)

    gen = sub.add_parser("generate", help="generate text offline from one or more prompts")
    gen.add_argument("--model", default="demo", help="checkpoint folder, or 'demo' (built-in)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda")
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
