"""The engine: requests in, one scheduled model step at a time, outputs out.

``add_request`` validates and queues; ``step`` schedules a batch, runs it, appends
the sampled tokens, detokenizes, applies stop conditions and frees finished
sequences' blocks; ``abort_request`` drops a request at once. Not thread-safe: the
server drives it from a single engine loop.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvscale.server.config import EngineConfig
from kvscale.server.engine.block_manager import BlockManager
from kvscale.server.engine.detokenizer import IncrementalDetokenizer
from kvscale.server.engine.model_runner import ModelRunner
from kvscale.server.engine.request import Request
from kvscale.server.engine.scheduler import Scheduler
from kvscale.server.engine.sequence import Sequence
from kvscale.server.model_config import ModelConfig
from kvscale.server.outputs import Logprob, RequestOutput
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot for metrics and the autoscaler."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_path(config.model)
        device = config.torch_device()
        dtype = config.torch_dtype(self.model_config, device)
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = _eos_ids(Path(config.model), self.model_config, self.tokenizer)
        self.runner = ModelRunner(
            self.model_config,
            config.model,
            dtype,
            device,
            config.block_size,
            config.num_kv_blocks,
            int(config.max_num_batched_tokens or 0),
            config.gpu_memory_utilization,
            config.attention_backend,
            config.seed,
            max_model_len=self.max_model_len,
            enforce_eager=config.enforce_eager,
            cuda_graph_max_batch=min(config.cuda_graph_max_batch, config.max_num_seqs),
            compile_model=config.compile,
        )
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size)
        if self.block_manager.blocks_for(self.max_model_len) > self.block_manager.num_blocks:
            capacity = self.block_manager.num_blocks * config.block_size
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.block_manager.num_blocks} blocks of "
                f"{config.block_size}), fewer than max_model_len={self.max_model_len}: raise "
                "num_kv_blocks / gpu_memory_utilization or lower max_model_len"
            )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, int(config.max_num_batched_tokens or 0)
        )
        self.device = device
        self.dtype = dtype
        self.stream_outputs = config.stream_outputs
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: Counter[str] = Counter()

    # ---- requests ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        """Raises ValueError naming what is wrong with a tokenized prompt."""
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}; the prompt must be shorter to leave room for output"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request. Raises ValueError (and queues nothing) for invalid input."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(prompt, str | list):
            raise ValueError("prompt must be a string or a list of token ids")
        prompt_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_ids)
        vocab = self.model_config.vocab_size
        bad_stop = [t for t in params.stop_token_ids or () if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be < vocab size {vocab}; got {bad_stop}")
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs, detoks = [], []
        for i in range(params.n):
            child = params.for_child(i)
            gen = None
            if child.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(child.seed)
            seqs.append(Sequence(next(self._seq_ids), request_id, i, prompt_ids, child, now, gen))
            detoks.append(
                IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            )
        req = Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_ids,
            params,
            seqs,
            detoks,
            now,
        )
        self.requests[request_id] = req
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Drops a request now and frees its blocks; False if it is not known."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
                seq.finished_time = time.monotonic()
        self._finished["abort"] += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one batch; returns the state of every request that got a token or finished
        (only finished ones when the config's ``stream_outputs`` is False)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        banned = {
            s.seq_id: self._min_tokens_ban(s)
            for s in batch.seqs
            if s.num_output_tokens < s.params.min_tokens
        }
        result = self.runner.execute(batch, banned)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for row, (seq, token) in enumerate(zip(result.seqs, result.token_ids, strict=True)):
            req = self.requests[seq.request_id]
            seq.append_token(token, now)
            self._generation_tokens += 1
            if seq.num_output_tokens == 1 and seq.index == 0:
                self._prompt_tokens += len(req.prompt_token_ids)
            lp = result.logprobs[row]
            if lp is not None and seq.logprobs is not None:
                seq.logprobs.append(self._logprob_entry(token, lp))
            detok = req.detokenizers[seq.index]
            # Offline runs read only final outputs: text is then made once at the end,
            # unless stop strings need it now.
            delta = ""
            if self.stream_outputs or seq.params.stop_strings:
                delta = detok.update([token])
            self._check_stop(seq, req, token, delta)
            if seq.finish_reason is not None:
                if not isinstance(seq.stop_reason, str):  # a stop string already cut it
                    detok.finish(seq.output_token_ids)
                self.scheduler.finish(seq)
                seq.finished_time = now
            touched[req.request_id] = req
        reqs = (
            touched.values() if self.stream_outputs else [r for r in touched.values() if r.finished]
        )
        outputs = [req.output() for req in reqs]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
                for c in out.outputs:
                    self._finished[c.finish_reason or "unknown"] += 1
        return outputs

    def _min_tokens_ban(self, seq: Sequence) -> list[int]:
        ban = list(seq.params.stop_token_ids or [])
        if not seq.params.ignore_eos:
            ban.extend(self.eos_token_ids)
        return ban

    def _logprob_entry(
        self, token: int, lp: tuple[list[int], list[float], float, int]
    ) -> dict[int, Logprob]:
        top_ids, top_lps, s_lp, rank = lp
        entry = {token: Logprob(s_lp, rank, self.tokenizer.decode([token]))}
        for r, (tid, val) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, r, self.tokenizer.decode([tid]))
        return entry

    def _check_stop(self, seq: Sequence, req: Request, token: int, delta: str) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in (p.stop_token_ids or ()):
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if p.stop_strings and delta:
                detok = req.detokenizers[seq.index]
                if _truncate_at_stop(detok, p.stop_strings, len(delta), seq):
                    return
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    # ---- introspection ---------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            finished=dict(self._finished),
        )


def _truncate_at_stop(
    detok: IncrementalDetokenizer, stops: tuple[str, ...], delta_len: int, seq: Sequence
) -> bool:
    """Finds the earliest stop string in the new text; cuts the text before it."""
    text = detok.text
    longest = max(len(s) for s in stops)
    search_from = max(0, len(text) - delta_len - longest + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, search_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return False
    detok.text = text[: best[0]]
    seq.finish_reason, seq.stop_reason = "stop", best[1]
    return True


def _eos_ids(path: Path, cfg: ModelConfig, tokenizer: Any) -> set[int]:
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
