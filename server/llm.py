"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.outputs import RequestOutput
from kvscale.server.sampling_params import SamplingParams

# vLLM's speculative_config keys -> EngineConfig settings
SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "ngram_min",
    "prompt_lookup_max": "ngram_max",
    "placement": "speculative_placement",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}


def speculative_settings(config: dict[str, Any]) -> dict[str, Any]:
    """``EngineConfig`` keywords from a vLLM-style ``speculative_config``."""
    unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key {unknown[0]!r}; allowed: {sorted(SPECULATIVE_KEYS)}"
        )
    return {SPECULATIVE_KEYS[k]: v for k, v in config.items()}


class LLM:
    """``LLM(model, **settings)``: ``model`` is a checkpoint folder or "demo"; the
    keywords are ``EngineConfig``'s settings (``dtype``, ``device``, ``block_size``,
    ``num_kv_blocks``, ``max_num_seqs``, ``max_model_len``, ``seed``, ...), with the same
    defaults and validation as ``kvscale serve``'s flags. ``speculative_config``: a
    dict with vLLM's keys (``method``: ngram | draft, ``model``,
    ``num_speculative_tokens``, ``prompt_lookup_min``, ``prompt_lookup_max``,
    ``disable_by_batch_size``) plus ``placement`` (inprocess | sidecar)."""

    def __init__(
        self, model: str, speculative_config: dict[str, Any] | None = None, **settings: Any
    ) -> None:
        if speculative_config is not None:
            settings.update(speculative_settings(speculative_config))
        # generate() returns final outputs only
        config = EngineConfig(model=model, **{**settings, "stream_outputs": False})
        self.engine = LLMEngine(config)
        self._counter = 0

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order. A single string or a single
        list of ints is one prompt. Raises ValueError before running anything if any
        prompt or setting is invalid."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
                )
        eng = self.engine
        # validate everything before queueing anything
        prepared = [eng.prepare(p, sp) for p, sp in zip(prompts, params, strict=True)]
        ids = []
        for p, prompt_ids, sp in zip(prompts, prepared, params, strict=True):
            rid = f"offline-{self._counter}"
            self._counter += 1
            eng.queue(rid, p, prompt_ids, sp)
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]
