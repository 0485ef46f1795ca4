"""``kvscale route``: flags, checks, and the process (uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os

from kvscale.router.balance import DEFAULT_EPSILON, DEFAULT_KV_THRESHOLD, DEFAULT_VNODES

EPILOG = """\
The router answers GET /health, GET /ready (200 once started, with the number of ready
replicas and held requests), GET /metrics (kvscale_router:*), and proxies every other
path to one replica. Policy prefix: consistent hashing with bounded loads over the engine's
block hash of the prompt's first --prefix-tokens tokens (chat: the rendered template);
prompts shorter than one block go to the least-loaded replica.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = " (default: %(default)s)"
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--upstream",
        nargs="+",
        metavar="URL",
        help="replica base URLs, e.g. http://10.0.0.5:8000 (a fixed list)",
    )
    src.add_argument(
        "--endpoint-slices",
        metavar="NAMESPACE/SERVICE",
        help="the replicas are the ready endpoints of this Service's EndpointSlices "
        "(in-cluster credentials, else the kubeconfig)",
    )
    p.add_argument(
        "--endpoint-port",
        default=None,
        help="with --endpoint-slices: the port number or name (default: the slice's first)",
    )
    p.add_argument(
        "--endpoints-interval",
        type=float,
        default=2.0,
        help="with --endpoint-slices: seconds before listing again after a failed list or "
        "watch (changes arrive through the watch at once)" + d,
    )
    p.add_argument(
        "--policy",
        choices=["prefix", "least-loaded", "random"],
        default="prefix",
        help="replica choice" + d,
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the model's checkpoint folder (its tokenizer and chat template), for --policy "
        "prefix (without it only token-id prompts get prefix affinity)",
    )
    p.add_argument("--chat-template", default=None, help="as given to the servers, if any")
    p.add_argument(
        "--block-size", type=int, default=16, help="the servers' KV-cache block size" + d
    )
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=64,
        help="leading prompt tokens hashed into the routing key, rounded down to whole "
        "blocks (at least one)" + d,
    )
    p.add_argument(
        "--load-epsilon",
        type=float,
        default=DEFAULT_EPSILON,
        help="a replica takes no new request above (1 + this) x the mean load" + d,
    )
    p.add_argument(
        "--kv-cache-threshold",
        type=float,
        default=DEFAULT_KV_THRESHOLD,
        help="a replica whose kvscale:kv_cache_usage_perc is at least this counts as over "
        "its bound" + d,
    )
    p.add_argument("--vnodes", type=int, default=DEFAULT_VNODES, help="ring points per replica" + d)
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=1.0,
        help="seconds between polls of each replica's /ready and /metrics" + d,
    )
    p.add_argument(
        "--hold-queue-size",
        type=int,
        default=256,
        help="requests held at most while no replica is ready (then 503 at once)" + d,
    )
    p.add_argument(
        "--hold-timeout",
        type=float,
        default=30.0,
        help="seconds a request waits for a ready replica before 503 + Retry-After" + d,
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $KVSCALE_API_KEY); "
        "the header is passed on to the replicas",
    )
    p.add_argument(
        "--prefix-cache-salt-per-key",
        action="store_true",
        help="as on the servers: the routing key includes the bearer token's digest",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=64 << 20,
        help="answer 413 to larger request bodies (0: no limit)" + d,
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let requests in flight finish" + d,
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on" + d)
    p.add_argument("--port", type=int, default=8080, help="port to listen on" + d)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity" + d,
    )
    p.add_argument("--seed", type=int, default=None, help="seed of --policy random")


def settings_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kvscale.router.app import RouterSettings

    if args.block_size < 1 or args.prefix_tokens < 1:
        raise ValueError("--block-size and --prefix-tokens must be >= 1")
    if args.load_epsilon < 0:
        raise ValueError(f"--load-epsilon must be >= 0, got {args.load_epsilon}")
    if not args.scrape_interval > 0 or args.hold_timeout < 0 or args.hold_queue_size < 0:
        raise ValueError("--scrape-interval must be > 0; --hold-* must be >= 0")
    if args.max_request_body_bytes < 0 or args.drain_timeout < 0:
        raise ValueError("--max-request-body-bytes and --drain-timeout must be >= 0")
    if args.endpoint_slices is not None and args.endpoint_slices.count("/") != 1:
        raise ValueError(f"--endpoint-slices takes NAMESPACE/SERVICE, got {args.endpoint_slices!r}")
    for u in args.upstream or ():
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--upstream takes http:// or https:// URLs, got {u!r}")
    return RouterSettings(
        policy=args.policy,
        block_size=args.block_size,
        prefix_blocks=max(1, args.prefix_tokens // args.block_size),
        epsilon=args.load_epsilon,
        kv_threshold=args.kv_cache_threshold,
        vnodes=args.vnodes,
        scrape_interval=args.scrape_interval,
        hold_queue_size=args.hold_queue_size,
        hold_timeout=args.hold_timeout,
        api_key=args.api_key or os.environ.get("KVSCALE_API_KEY") or None,
        prefix_cache_salt_per_key=args.prefix_cache_salt_per_key,
        seed=args.seed,
        max_body_bytes=args.max_request_body_bytes,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvscale.router.app import RouterApp
    from kvscale.router.endpoints import EndpointSource, StaticEndpoints
    from kvscale.router.prompt import PromptTokenizer

    settings = settings_from_args(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per poll
    tokenizer = None
    if args.policy == "prefix":
        if args.tokenizer:
            tokenizer = PromptTokenizer(args.tokenizer, _read(args.chat_template))
        else:
            logging.getLogger("kvscale.router").warning(
                "no --tokenizer: only token-id prompts get prefix affinity, text and chat "
                "requests go to the least-loaded replica"
            )
    if args.upstream:
        source: EndpointSource = StaticEndpoints(args.upstream)
    else:
        from kvscale.router.kube import EndpointSliceSource, parse_port

        ns, svc = args.endpoint_slices.split("/")
        source = EndpointSliceSource(
            ns, svc, parse_port(args.endpoint_port), args.endpoints_interval
        )
    app = RouterApp(settings, source, tokenizer)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=max(1, int(args.drain_timeout)),
    )
    return 0


def _read(path: str | None) -> str | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()
