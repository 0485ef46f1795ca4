"""``kvscale serve``: checks the flags, then runs the app under uvicorn until drained."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

from kvscale.bounds import Bound
from kvscale.server.config import EngineConfig

log = logging.getLogger("kvscale.server")

API_KEY_ENV = "KVSCALE_API_KEY"
GRACEFUL_CLOSE_S = 3.0  # after the drain: how long uvicorn waits for connections to close
# An idle keep-alive connection is closed after this many seconds (uvicorn's default, as in
# vLLM and SGLang). A pooling client must drop idle connections sooner, or it can send a
# request on one the server is closing (kvscale.bench_serve.CLIENT_KEEPALIVE_S).
KEEP_ALIVE_S = 5


class UsageError(ValueError):
    """A flag value the server cannot start with (exit code 2)."""


# The bounds of the server's own number flags (EngineConfig's settings carry theirs); the
# operator's table of server flags is generated from both (kvscale.operator.server_flags).
FLAG_BOUNDS = {
    "--port": Bound(0, 65535),
    "--max-queue-len": Bound(1),
    "--drain-timeout": Bound(0),
    "--max-request-body-bytes": Bound(0),  # 0: no limit
    "--max-header-bytes": Bound(1024),
    "--request-read-timeout": Bound(0, lo_exclusive=True),
    "--engine-stall-timeout": Bound(0, lo_exclusive=True),
}


def check_flags(args: argparse.Namespace) -> EngineConfig:
    """Rejects impossible server flags; returns the engine settings, which validate
    themselves (unsupported features and bad values raise ValueError: exit code 2)."""
    for flag, bound in FLAG_BOUNDS.items():
        why = bound.refusal(flag, getattr(args, flag[2:].replace("-", "_")))
        if why is not None:
            raise UsageError(why)
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise UsageError(f"--chat-template: no such file {args.chat_template!r}")
    return EngineConfig.from_args(args)


def check_api_key(key: str | None) -> str | None:
    """The API key, or UsageError for one no client could send: HTTP header values are
    visible characters, and the bearer token is compared without surrounding spaces.
    Non-ASCII keys are allowed (clients send them as UTF-8)."""
    if key is None or key == "":
        return None
    if key != key.strip() or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in key):
        raise UsageError(
            "the API key (--api-key or $KVSCALE_API_KEY) must not contain control characters "
            "or start or end with whitespace: no client could send it in a header"
        )
    return key


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings (validated now; the model path is resolved when loading)."""
    cfg = check_flags(args)
    cfg.torch_device()  # a missing GPU is a usage error, found before anything loads
    return cfg


def _engine_factory(cfg: EngineConfig, log_level: str):  # type: ignore[no-untyped-def]
    def build():  # type: ignore[no-untyped-def]
        from kvscale.server.process.async_engine import AsyncEngine

        if cfg.model == "demo":
            log.info("[1/3] preparing the demo checkpoint (built on first use) ...")
            t0 = time.perf_counter()
            path = cfg.resolve_model_path()
            log.info("[1/3] demo checkpoint at %s (%.1fs)", path, time.perf_counter() - t0)
        else:
            path = cfg.resolve_model_path()
        return AsyncEngine(dataclasses.replace(cfg, model=path), log_level=log_level)

    return build


def run_server(args: argparse.Namespace) -> int:
    """Runs until SIGTERM (drain, exit 0) or SIGINT; 1 if the model failed to load, the
    engine process died, or a forced shutdown cut requests in flight."""
    import uvicorn

    from kvscale.server.api.app import create_app
    from kvscale.server.api.http_limits import limited_protocol
    from kvscale.server.api.lifecycle import DrainingServer
    from kvscale.server.api.state import ServerSettings

    cfg = engine_config(args)
    api_key = check_api_key(args.api_key or os.environ.get(API_KEY_ENV))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    chat_template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model],
        model_path=args.model,
        api_key=api_key,
        max_queue_len=args.max_queue_len,
        drain_timeout=args.drain_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        engine_stall_timeout=args.engine_stall_timeout,
        warmup=not args.no_warmup,
        chat_template=chat_template,
        prefix_cache_salt_per_key=args.prefix_cache_salt_per_key,
        tool_call_parser=args.tool_call_parser,
    )
    app = create_app(settings, _engine_factory(cfg, args.log_level))
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=int(GRACEFUL_CLOSE_S),
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=not args.disable_access_log,
        http=limited_protocol(
            args.max_header_bytes, args.request_read_timeout, args.request_read_timeout
        ),
        h11_max_incomplete_event_size=args.max_header_bytes,
    )
    lifecycle = app.state.server.lifecycle
    server = DrainingServer(config, lifecycle)
    server.run()
    if lifecycle.fatal_error:
        print(f"kvscale serve: error: {lifecycle.fatal_error}", file=sys.stderr)
    return lifecycle.exit_code
