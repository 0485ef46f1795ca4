"""A sequence: one sample of one request, with its tokens, blocks and timestamps."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvscale.server.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """``token_ids`` is prompt + output so far; ``num_computed_tokens`` of them are in the cache.

    The engine launches a step before the previous one's tokens reach the host, so the
    last one or two output tokens may be placeholders, ``-(row + 1)``, for tokens still on
    the device (see ``step_inputs``). ``stopping``: the newest placeholder is the
    sequence's last token (``max_tokens`` or the context is reached), so there is nothing
    more to compute for it.
    """

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None
    stopping: bool = False
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    cache_salt: str | None = None  # enters the first block's hash (prefix cache isolation)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of final tokens
    num_committed_blocks: int = 0  # leading blocks of block_table registered in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    grammar: Any = None  # the grammar matcher of a constrained sequence (engine side)
    prompt_lps: list[Any] | None = None  # prompt logprobs so far (when asked for)
    prompt_lp_next: int = 0  # first prompt position whose logprobs are not asked for yet
    # speculative decoding: tokens drafted for the next step (fed after the last token and
    # verified), and the distribution each was sampled from ((ids [d, M], probs [d, M]);
    # None: point masses)
    draft_tokens: list[int] = field(default_factory=list)
    draft_q: tuple[Any, Any] | None = None
    # drafts left on the device (``Speculator.on_device``): ``draft_tokens`` are
    # placeholders and the values start at this flat index of the step's device drafts
    # (-1: the values are in ``draft_tokens``)
    draft_src: int = -1
    spec_k: int = 0  # drafts to ask for next (adapted to this sequence's acceptance)
    spec_acceptance: float = 1.0  # moving average of accepted / drafted
    spec_pause: int = 0  # steps left without drafting (poor acceptance, empty proposals)
    spec_misses: int = 0  # proposals in a row that drafted nothing

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_lps = []

    @property
    def constrained(self) -> bool:
        """A grammar constrains this sequence's tokens (speculative decoding does not
        draft for it)."""
        return self.grammar is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(now)

    def drop_placeholders(self) -> None:
        """Removes trailing placeholder tokens (of steps whose results no longer matter)."""
        while len(self.token_ids) > self.num_prompt_tokens and self.token_ids[-1] < 0:
            self.token_ids.pop()
