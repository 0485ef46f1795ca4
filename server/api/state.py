"""What the HTTP layer shares: settings, the engine (once loaded), metrics, lifecycle."""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.server.api.errors import APIError
from kvscale.server.api.http_limits import MIN_BODY_LIMIT, default_body_limit
from kvscale.server.api.lifecycle import Lifecycle
from kvscale.server.api.metrics import ServerMetrics
from kvscale.server.api.tool_parsers import detect_parser
from kvscale.server.process.async_engine import AsyncEngine


@dataclass
class ServerSettings:
    """Server options that are not engine options."""

    served_model_names: list[str]
    model_path: str = ""
    api_key: str | None = None
    max_queue_len: int | None = None
    drain_timeout: float = 30.0  # seconds
    warmup: bool = True
    chat_template: str | None = None  # Jinja source overriding the tokenizer's
    prefix_cache_salt_per_key: bool = False  # the bearer token salts each request's cache
    tool_call_parser: str | None = None  # None: the chat template's format, if known
    max_request_body_bytes: int | None = None  # None: derived from max_model_len; 0: none
    engine_stall_timeout: float = 30.0  # seconds of engine silence before it counts as stalled

    @property
    def model_name(self) -> str:
        """The name used in responses and metric labels."""
        return self.served_model_names[0]


@dataclass
class ServerState:
    settings: ServerSettings
    lifecycle: Lifecycle
    metrics: ServerMetrics
    engine: AsyncEngine | None = None  # set once the model is loaded

    def tool_parser(self) -> str | None:
        """The tool-call format to read: ``--tool-call-parser``, else the one the chat
        template teaches (None: unknown, so tool_choice auto is refused)."""
        if self.settings.tool_call_parser:
            return self.settings.tool_call_parser
        template = self.settings.chat_template
        if template is None and self.engine is not None:
            template = getattr(self.engine.tokenizer, "chat_template", None)
        return detect_parser(template if isinstance(template, str) else None)

    def body_limit(self) -> int | None:
        """The largest request body accepted, in bytes (None: no limit)."""
        limit = self.settings.max_request_body_bytes
        if limit is not None:
            return limit or None
        eng = self.engine
        return MIN_BODY_LIMIT if eng is None else default_body_limit(eng.max_model_len)

    def require_engine(self) -> AsyncEngine:
        """The engine, or a 503 while the model loads (or after the engine died)."""
        eng = self.engine
        if eng is None or not self.lifecycle.loaded:
            raise APIError(503, "the model is still loading; retry shortly", code="loading")
        if not eng.is_alive():
            raise APIError(503, "the engine loop is not running", code="engine_dead")
        if eng.stalled:
            raise APIError(
                503,
                f"the engine has not answered for {eng.seconds_since_heartbeat():.0f}s; "
                "retry later",
                code="engine_stalled",
                headers={"Retry-After": "5"},
            )
        return eng

    def check_model(self, name: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.settings.model_name
        if name not in self.settings.served_model_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist. This server serves "
                f"{', '.join(self.settings.served_model_names)}.",
                param="model",
                code="model_not_found",
            )
        return name
