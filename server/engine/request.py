"""A request as the engine core holds it (one sequence per sample), and the checks every
request passes before it is queued."""

from __future__ import annotations

from dataclasses import dataclass

from kvscale.server.engine.sequence import Sequence
from kvscale.server.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def check_prompt(prompt_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raises ValueError naming what is wrong with a tokenized prompt."""
    if not prompt_ids:
        raise ValueError("prompt must not be empty")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens, but max_model_len is "
            f"{max_model_len}; the prompt must be shorter to leave room for output"
        )


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """Raises ValueError for settings that only the model can judge (token ids)."""
    bad_stop = [t for t in params.stop_token_ids or () if t >= vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids must be < vocab size {vocab_size}; got {bad_stop}")
