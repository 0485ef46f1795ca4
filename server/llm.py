"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from kvscale.server.config import EngineConfig
from kvscale.server.engine.llm_engine import LLMEngine
from kvscale.server.outputs import RequestOutput
from kvscale.server.sampling_params import SamplingParams


def resolve_model(model: str) -> str:
    """``"demo"`` is the built-in random-weight demo checkpoint (built on first use)."""
    if model == "demo":
        from kvscale.server.demo_model import demo_model_path

        return str(demo_model_path())
    return str(Path(model))


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        attention_backend: str = "auto",
        tokenizer: str | None = None,
        enforce_eager: bool = False,
        cuda_graph_max_batch: int = 256,
        compile: bool = False,
    ) -> None:
        self.engine = LLMEngine(
            EngineConfig(
                model=resolve_model(model),
                tokenizer=tokenizer,
                dtype=dtype,
                device=device,
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                attention_backend=attention_backend,
                seed=seed,
                enforce_eager=enforce_eager,
                cuda_graph_max_batch=cuda_graph_max_batch,
                compile=compile,
                stream_outputs=False,  # generate() returns final outputs only
            )
        )
        self._counter = 0

    def get_tokenizer(self):
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
        for p in prompts:  # validate everything before queueing anything
            if not isinstance(p, str | list):
                raise ValueError(f"prompts must be strings or token-id lists, got {type(p)}")
            eng.validate_prompt(eng.tokenize(p))
        ids = []
        for p, sp in zip(prompts, params, strict=True):
            rid = f"offline-{self._counter}"
            self._counter += 1
            eng.add_request(rid, p, sp)
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]
