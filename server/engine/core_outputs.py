"""What the engine core reports: per-sequence token updates and a stats snapshot.

Both cross the process boundary between the engine process and the API server, so
they are small, picklable tuples and dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# (top ids, top logprobs, sampled token's logprob, its rank) of one sampled token
RowLogprobs = tuple[list[int], list[float], float, int]


class SeqUpdate(NamedTuple):
    """One new token of one sequence (sample ``index`` of ``request_id``)."""

    request_id: str
    index: int
    token_id: int
    logprobs: RowLogprobs | None
    finish_reason: str | None  # "stop" (EOS or a stop token) | "length" | None
    stop_reason: int | None  # the stop token id, when one ended it
    first_scheduled_time: float | None  # time.monotonic(), sent with the first token only
    # with the first token of a request that asked for them: the logprobs of prompt
    # tokens 1.. (token 0 has none), each (top ids, top logprobs, logprob, rank)
    prompt_logprobs: list[RowLogprobs] | None = None


@dataclass
class EngineStats:
    """A snapshot for metrics and the autoscaler. ``finished`` (sequences by finish
    reason; an abort counts once per request) is kept by the output side."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of those, tokens found
    # speculative decoding (cumulative; see engine.speculation.SpecStats)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_draft_available: bool | None = None  # a draft sidecar answers (None: no sidecar)
    spec_draft_failures: int = 0  # proposal calls the draft sidecar failed
