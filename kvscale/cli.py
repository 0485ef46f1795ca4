"""Command line: ``kvscale generate`` (offline generation on a checkpoint or the demo model)."""

from __future__ import annotations

import argparse
import sys
import time


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvscale", description="LLM serving on Kubernetes.")
    sub = parser.add_subparsers(dest="command", required=True)
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
        print(f"kvscale: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
