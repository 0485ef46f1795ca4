"""Token updates in, RequestOutputs out: detokenization, stop strings, logprob tokens.

The engine core reports token ids; this side turns them into text. It holds each
request's samples, runs their incremental detokenizers, finds stop strings (cutting
the text before them, and telling the caller which sequences the core must stop) and
holds back the tail of the text that might still become a stop string. In the server
it runs in the API process, so detokenization never stalls the engine loop; the
offline ``LLMEngine`` runs it in-process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.engine.core_outputs import RowLogprobs, SeqUpdate
from kvscale.server.engine.detokenizer import IncrementalDetokenizer, decoder, token_texts
from kvscale.server.outputs import CompletionOutput, Logprob, RequestOutput
from kvscale.server.sampling_params import SamplingParams


@dataclass(eq=False)
class SampleState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    arrival_time: float
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def output(self) -> RequestOutput:
        """The request's state now: cumulative text and tokens of every sample."""
        hold = max((len(s) for s in self.params.stop_strings), default=1) - 1
        outs = []
        for s in self.samples:
            text = s.detok.text
            if hold and s.finish_reason is None:
                # a stop string may be forming at the end: show it only once it can't be one
                text = text[: max(0, len(text) - hold)]
            outs.append(
                CompletionOutput(
                    index=s.index,
                    text=text,
                    token_ids=list(s.token_ids),
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    logprobs=list(s.logprobs) if s.logprobs is not None else None,
                )
            )
        finished = self.finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=finished,
            metrics=self.metrics() if finished else {},
            prompt_logprobs=self.prompt_logprobs,
        )

    def metrics(self) -> dict[str, float]:
        """Timestamps (time.monotonic seconds) and counts for the server's histograms."""
        first_sched = [s.first_scheduled_time for s in self.samples if s.first_scheduled_time]
        first_tok = [s.first_token_time for s in self.samples if s.first_token_time]
        done = [s.finished_time for s in self.samples if s.finished_time]
        m: dict[str, float] = {
            "arrival_time": self.arrival_time,
            "num_prompt_tokens": float(len(self.prompt_token_ids)),
            "num_generation_tokens": float(sum(len(s.token_ids) for s in self.samples)),
        }
        if first_sched:
            m["first_scheduled_time"] = min(first_sched)
        if first_tok:
            m["first_token_time"] = min(first_tok)
        if done:
            m["finished_time"] = max(done)
        return m


class OutputProcessor:
    """``stream``: every update yields the request's output; otherwise only finished
    requests do, and their text is decoded once at the end (unless stop strings need
    it sooner)."""

    def __init__(self, tokenizer: Any, stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.decode = decoder(tokenizer)
        self.token_text = token_texts(tokenizer, self.decode)  # logprobs' token strings
        self.stream = stream
        self.requests: dict[str, RequestState] = {}
        self.finished: Counter[str] = Counter()  # sequences by reason; aborts per request

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        skip = params.skip_special_tokens
        samples = [
            SampleState(
                i,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip, self.decode),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, samples, arrival_time
        )

    def abort(self, request_id: str) -> bool:
        """Forgets a request (counted once as an abort); False if it is not known."""
        if self.requests.pop(request_id, None) is None:
            return False
        self.finished["abort"] += 1
        return True

    def process(
        self, updates: list[SeqUpdate], now: float
    ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Applies one step's updates. Returns the outputs to deliver and the
        ``(request_id, index)`` of sequences a stop string ended, which the core must stop."""
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        for u in updates:
            req = self.requests.get(u.request_id)
            if req is None:
                continue
            s = req.samples[u.index]
            if u.prompt_logprobs is not None and req.prompt_logprobs is None:
                ids = req.prompt_token_ids
                req.prompt_logprobs = [None] + [
                    self._logprob_entry(ids[j + 1], lp) for j, lp in enumerate(u.prompt_logprobs)
                ]
            if s.finish_reason is not None:  # ended here by a stop string; the core ran on
                continue
            s.token_ids.append(u.token_id)
            if len(s.token_ids) == 1:
                s.first_token_time = now
                s.first_scheduled_time = u.first_scheduled_time
            if u.logprobs is not None and s.logprobs is not None:
                s.logprobs.append(self._logprob_entry(u.token_id, u.logprobs))
            p = req.params
            delta = s.detok.update([u.token_id]) if self.stream or p.stop_strings else ""
            if u.finish_reason == "stop":  # EOS or a stop token: before any stop string
                s.finish_reason, s.stop_reason = "stop", u.stop_reason
            elif (
                p.stop_strings
                and delta
                and len(s.token_ids) >= p.min_tokens
                and _truncate_at_stop(s, p.stop_strings, len(delta))
            ):
                if u.finish_reason is None:
                    stopped.append((u.request_id, u.index))
            elif u.finish_reason is not None:
                s.finish_reason = u.finish_reason
            if s.finish_reason is not None:
                if not isinstance(s.stop_reason, str):  # a stop string already cut the text
                    s.detok.finish(s.token_ids)
                s.finished_time = now
            touched[u.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                del self.requests[req.request_id]
                for s in req.samples:
                    self.finished[s.finish_reason or "unknown"] += 1
                outputs.append(req.output())
            elif self.stream:
                outputs.append(req.output())
        return outputs, stopped

    def _logprob_entry(self, token: int, lp: RowLogprobs) -> dict[int, Logprob]:
        top_ids, top_lps, s_lp, rank = lp
        text = self.token_text
        entry = {token: Logprob(s_lp, rank, text(token))}
        for r, (tid, val) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            if tid not in entry:
                entry[tid] = Logprob(val, r, text(tid))
        return entry


def _truncate_at_stop(s: SampleState, stops: tuple[str, ...], delta_len: int) -> bool:
    """Finds the earliest stop string in the new text; cuts the text before it."""
    text = s.detok.text
    longest = max(len(x) for x in stops)
    search_from = max(0, len(text) - delta_len - longest + 1)
    best: tuple[int, str] | None = None
    for x in stops:
        i = text.find(x, search_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, x)
    if best is None:
        return False
    s.detok.text = text[: best[0]]
    s.finish_reason, s.stop_reason = "stop", best[1]
    return True
