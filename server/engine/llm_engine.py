"""The in-process engine: tokenizer + engine core + output processor.

``add_request`` tokenizes, validates (once, ``validate_request``) and queues; ``step``
runs one pipelined core step (``engine_core``) and turns its token updates into
RequestOutputs (``output_processor``), stopping in the core any sequence a stop string
ended; ``abort_request`` drops a request at once. The offline ``LLM`` uses it directly;
the server runs the core in its own process and the output side in the API process
(``process.async_engine``). Not thread-safe.
"""

from __future__ import annotations

import time
from typing import Any

from kvscale.server.config import EngineConfig
from kvscale.server.engine.core_outputs import EngineStats
from kvscale.server.engine.engine_core import EngineCore
from kvscale.server.engine.output_processor import OutputProcessor
from kvscale.server.engine.request import validate_request
from kvscale.server.errors import InvalidRequestError
from kvscale.server.outputs import RequestOutput
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.structured.params import check as check_grammar
from kvscale.server.worker.worker import Worker

__all__ = ["EngineStats", "LLMEngine"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config, self.tokenizer = config.load()
        self.model_config = self.config.model
        self.max_model_len = self.config.max_model_len
        self.eos_token_ids = set(self.config.eos_token_ids)
        self.core = EngineCore(self.config)
        self.processor = OutputProcessor(self.tokenizer, stream=config.stream_outputs)
        self.device = self.core.device
        self.dtype = self.core.dtype

    @property
    def worker(self) -> Worker:
        return self.core.worker

    @property
    def block_manager(self):  # type: ignore[no-untyped-def]
        return self.core.block_manager

    @property
    def requests(self) -> dict[str, Any]:
        """Requests not finished yet (by id)."""
        return self.processor.requests

    # ---- requests ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, validated with ``params``; raises InvalidRequestError."""
        if not isinstance(prompt, str | list):
            raise InvalidRequestError(
                "prompt must be a string or a list of token ids", param="prompt"
            )
        prompt_ids = self.tokenize(prompt)
        validate_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)
        return prompt_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request. Raises ValueError (and queues nothing) for invalid input."""
        params = params or SamplingParams()
        prompt_ids = self.prepare(prompt, params)
        self.queue(request_id, prompt, prompt_ids, params, arrival_time, cache_salt)

    def queue(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queues a request whose ``prompt_ids`` came from ``prepare``; ``cache_salt``:
        it shares prefix-cache blocks only with requests of the same salt."""
        if request_id in self.processor.requests or request_id in self.core.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        now = arrival_time if arrival_time is not None else time.monotonic()
        self.core.add_request(request_id, prompt_ids, params, now, cache_salt)
        text = prompt if isinstance(prompt, str) else None
        self.processor.add(request_id, text, prompt_ids, params, now)

    def abort_request(self, request_id: str) -> bool:
        """Drops a request now and frees its blocks; False if it is not known."""
        self.core.abort_request(request_id)
        return self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.processor.requests)

    # ---- one step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one core step; returns the state of every request that got a token or
        finished (only finished ones when the config's ``stream_outputs`` is False)."""
        updates = self.core.step()
        outputs, stopped = self.processor.process(updates, time.monotonic())
        for request_id, index in stopped:
            self.core.finish_sequence(request_id, index)
        refused = self.core.take_refused()
        for request_id, _ in refused:
            self.processor.abort(request_id)
        if refused:
            rid, reason = refused[0]
            raise InvalidRequestError(f"request {rid!r} was dropped: {reason}")
        return outputs

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix block; returns how many were dropped."""
        return self.core.reset_prefix_cache()

    def stats(self) -> EngineStats:
        s = self.core.stats()
        s.finished = dict(self.processor.finished)
        return s
