"""A request: its prompt, settings, and one sequence + detokenizer per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.server.engine.detokenizer import IncrementalDetokenizer
from kvscale.server.engine.sequence import Sequence
from kvscale.server.outputs import CompletionOutput, RequestOutput
from kvscale.server.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The request's state now: cumulative text and tokens of every sample."""
        hold = max((len(s) for s in self.params.stop_strings), default=1) - 1
        outs = []
        for seq, detok in zip(self.seqs, self.detokenizers, strict=True):
            text = detok.text
            if hold and not seq.is_finished:
                # a stop string may be forming at the end: show it only once it can't be one
                text = text[: max(0, len(text) - hold)]
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=seq.logprobs,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            metrics=self.metrics() if self.finished else {},
        )

    def metrics(self) -> dict[str, float]:
        """Timestamps (time.monotonic seconds) and counts for the server's histograms."""
        first_sched = [s.first_scheduled_time for s in self.seqs if s.first_scheduled_time]
        first_tok = [s.first_token_time for s in self.seqs if s.first_token_time]
        done = [s.finished_time for s in self.seqs if s.finished_time]
        m: dict[str, float] = {
            "arrival_time": self.arrival_time,
            "num_prompt_tokens": float(len(self.prompt_token_ids)),
            "num_generation_tokens": float(sum(s.num_output_tokens for s in self.seqs)),
        }
        if first_sched:
            m["first_scheduled_time"] = min(first_sched)
        if first_tok:
            m["first_token_time"] = min(first_tok)
        if done:
            m["finished_time"] = max(done)
        return m
