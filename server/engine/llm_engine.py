"""The in-process engine: tokenizer + engine core + output processor.

``add_request`` tokenizes, validates and queues; ``step`` runs one pipelined core step
(``engine_core``) and turns its token updates into RequestOutputs
(``output_processor``), stopping in the core any sequence a stop string ended;
``abort_request`` drops a request at once. The offline ``LLM`` uses it directly; the
server runs the core in its own process and the output side in the API process
(``async_engine``). Not thread-safe.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvscale.server.config import EngineConfig
from kvscale.server.engine.core_outputs import EngineStats
from kvscale.server.engine.engine_core import EngineCore
from kvscale.server.engine.output_processor import OutputProcessor
from kvscale.server.model_config import ModelConfig
from kvscale.server.outputs import RequestOutput
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.tokenizer import load_tokenizer

__all__ = ["EngineStats", "LLMEngine", "eos_token_ids"]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_path(config.model)
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = eos_token_ids(Path(config.model), self.model_config, self.tokenizer)
        self.core = EngineCore(config, self.model_config, self.eos_token_ids, self.max_model_len)
        self.processor = OutputProcessor(self.tokenizer, stream=config.stream_outputs)
        self.device = self.core.device
        self.dtype = self.core.dtype

    @property
    def runner(self):  # type: ignore[no-untyped-def]
        return self.core.runner

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

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        """Raises ValueError naming what is wrong with a tokenized prompt."""
        self.core.check_request(prompt_ids, SamplingParams())

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request. Raises ValueError (and queues nothing) for invalid input."""
        params = params or SamplingParams()
        if request_id in self.processor.requests or request_id in self.core.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(prompt, str | list):
            raise ValueError("prompt must be a string or a list of token ids")
        prompt_ids = self.tokenize(prompt)
        now = arrival_time if arrival_time is not None else time.monotonic()
        self.core.add_request(request_id, prompt_ids, params, now)
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
        return outputs

    def stats(self) -> EngineStats:
        s = self.core.stats()
        s.finished = dict(self.processor.finished)
        return s


def eos_token_ids(path: Path, cfg: ModelConfig, tokenizer: Any) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer."""
    ids = set(cfg.eos_token_ids)
    gen_cfg = path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if isinstance(eos, list):
            ids.update(int(e) for e in eos)
        elif eos is not None:
            ids.add(int(eos))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
